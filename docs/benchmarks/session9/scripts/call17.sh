#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c17; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
source tools/gpu_build.sh > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
cp "$out/gpu.txt" "$work/" 2>/dev/null
save() { tar czf "$out/c17.tgz" -C "$work" .; }
step() {
    local name=$1; shift; local t0=$SECONDS
    "$@" > "$work/$name.log" 2>&1; local rc=$?; echo "== $name rc=$rc $((SECONDS - t0))s"; tail -${TAILN:-3} "$work/$name.log"; save
    return $rc
}
TAILN=3 step gpu_tests timeout 150 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider
tests_rc=$?
step memcheck timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "attention_stats"
TAILN=6 step ttft timeout 150 python3 tools/profile_ttft.py --ttft 9 --timeline --out "$work/profile_ttft.json"
for shape in prefill recompute; do
  step ncu_$shape timeout 120 ncu --kernel-name regex:mma_attention_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats python3 .ab/ncu_attn.py $shape
done
if [ $tests_rc -eq 0 ]; then
  step bench timeout 170 python3 -m conduit_rt.bench --out "$work/bench"
  grep -E "^\| " "$work/bench/benchmarks.md" | head -26 | cut -c1-160
fi
