#!/usr/bin/env bash
# On a GPU machine (the device tool), one call: build for this GPU, the emulator checked against the
# real GPU, every GPU test, compute-sanitizer on the newest kernels, then `conduit bench`. Logs and
# results go to $OUT/validate.tgz (one file: the device tool fetches at most 8); summaries to stdout.
# Usage: bash tools/gpu_validate.sh [pytest -k expression for the sanitizer runs]
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/validate; mkdir -p "$out" "$work"
source "$(dirname "$0")/gpu_build.sh" > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
sanitize="${1:-tests/test_topk.py tests/test_restore_batch.py}"
step() {  # step NAME COMMAND...: log to $work/NAME.log, print its tail, refresh the archive
    local name=$1; shift; local t0=$SECONDS
    "$@" > "$work/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS - t0))s"; tail -4 "$work/$name.log"
    tar czf "$out/validate.tgz" -C "$work" .
}
step emu_gpu timeout 120 python3 kernels/cuda/emu/run_emu.py --gpu
step gpu_tests timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider
step memcheck timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -m gpu -p no:cacheprovider $sanitize
step racecheck timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 python3 -m pytest -q -m gpu -p no:cacheprovider $sanitize
step bench timeout 150 python3 -m conduit_rt.bench --out "$work/bench"
grep -E "^\| " "$work/bench/benchmarks.md" | head -40
