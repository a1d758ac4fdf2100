#!/usr/bin/env bash
# Thirteenth session, call 35: the producer's copy loop unrolled (prod-u4) against prod and main, then
# Nsight Compute on the chunk of main and of the producer build: where the consumers stall.
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c35; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c35.tgz" -C "$work" .; }
SECONDS=0
timeout 200 python3 tools/ab_builds.py run --prefill --rounds 0 --out "$work/ab_build.json" > "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"; tail -2 "$work/build.log"
CONDUIT_LIB=/tmp/ab-build-prod-u4/libconduit.so timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk or sdpa_reference" > "$work/tk_prod-u4.log" 2>&1; echo "tests prod-u4 rc=$? t=$SECONDS"; tail -1 "$work/tk_prod-u4.log"
timeout 200 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -4 "$work/ab.log"; save
for v in prod main; do
  left=$((570 - SECONDS)); [ $left -lt 40 ] && break
  CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout $((left / 2)) ncu --clock-control none --kernel-name regex:mma_attention_kernel --launch-skip 2 --launch-count 1 --section WarpStateStats --section SchedulerStats --section SpeedOfLight --section SourceCounters -o /tmp/rep_$v python3 .ab/ncu_attn.py prefill > "$work/ncu_run_$v.txt" 2>&1; echo "ncu $v rc=$? t=$SECONDS"
  ncu -i /tmp/rep_$v.ncu-rep --page details --print-details all > "$work/ncu_details_$v.txt" 2>&1
  ncu -i /tmp/rep_$v.ncu-rep --page source --csv --print-source sass > "$work/ncu_source_$v.csv" 2>&1; echo "source rc=$? $(wc -c < $work/ncu_source_$v.csv)"
  grep -iE "stall|Warp Cycles|Eligible|Issue Slots|Duration" "$work/ncu_details_$v.txt" | head -14
  save
done
