#!/usr/bin/env bash
set -uo pipefail
# .ab/ncu_attn.py is docs/benchmarks/session9/scripts/ncu_attn.py
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c23; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
timeout 300 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$?"; tail -7 "$work/ab.log"
tar czf "$out/c23.tgz" -C "$work" .
export CONDUIT_LIB=/tmp/ab-build-wg/libconduit.so
timeout 150 ncu --kernel-name regex:mma_attention_kernel --launch-skip 2 --launch-count 1 --set full --import-source yes -o /tmp/rep python3 .ab/ncu_attn.py prefill > "$work/ncu_run.txt" 2>&1; echo "ncu rc=$?"
ncu -i /tmp/rep.ncu-rep --page details --print-details all > "$work/ncu_details.txt" 2>&1
ncu -i /tmp/rep.ncu-rep --page raw --csv > "$work/ncu_raw.csv" 2>&1
ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > "$work/ncu_source_sass.csv" 2>&1; echo "src rc=$?"
grep -iE "stall|Warp Cycles|Eligible|Issue Slots|Duration|Registers|Tensor" "$work/ncu_details.txt" | head -40
tar czf "$out/c23.tgz" -C "$work" .
