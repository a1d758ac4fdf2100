#!/usr/bin/env bash
# Twelfth session, call 30: A/B of the wgmma attention's issue-side changes (descriptors, the P V wait
# below the exponentials, the tree maxima; 4 warps / 4 stages as probes), then the winner's tests.
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c30; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c30.tgz" -C "$work" .; }
SECONDS=0
timeout 390 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -9 "$work/ab.log"; save
pick=$(python3 tools/ab_builds.py fastest "$work/ab_prefill.json"); echo "picked $pick" | tee "$work/pick.txt"
for v in wg-tree wg-late-wait; do
  CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 45 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$work/tests_$v.log" 2>&1; echo "kernels $v rc=$? t=$SECONDS"; tail -1 "$work/tests_$v.log"
done; save
CONDUIT_LIB=/tmp/ab-build-wg-tree/libconduit.so timeout 30 python3 .ab/wg_probe.py > "$work/probe.log" 2>&1; tail -2 "$work/probe.log"
left=$((560 - SECONDS)); echo "ncu budget $left s"
if [ $left -gt 60 ]; then
  CONDUIT_LIB=/tmp/ab-build-wg-tree/libconduit.so timeout $((left - 15)) ncu --clock-control none --kernel-name regex:mma_attention_kernel --launch-skip 2 --launch-count 1 --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section SpeedOfLight -o /tmp/rep python3 .ab/ncu_attn.py prefill > "$work/ncu_run.txt" 2>&1; echo "ncu rc=$? t=$SECONDS"
  ncu -i /tmp/rep.ncu-rep --page details --print-details all > "$work/ncu_details.txt" 2>&1
  grep -iE "stall|Warp Cycles|Eligible|Issue Slots|Duration|Tensor|Frequency" "$work/ncu_details.txt" | head -40
fi
save
