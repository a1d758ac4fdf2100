#!/usr/bin/env bash
# Fifteenth session, call 45 (the last device minutes): racecheck of our kernels file by file, each
# file its own process, so that the sanitizer's crash on cuBLAS's first half-precision GEMM under a
# kernel filter (call 44's probes: one F.linear reproduces it; without the filter it runs, but
# checking every torch kernel takes the model-level files past any call's time) stops only that
# file; test_kernels.py with the default choice of warps (call 43 forced 8). Then conduit bench on
# main (the uneven split plan reverted).
set -uo pipefail
source tools/gpu_call.sh c45
cmake -S . -B /tmp/c45-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c45-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c45-build/libconduit.so
race() {  # test file
    local name; name=$(basename "$1" .py)
    timeout 120 compute-sanitizer --tool racecheck --kernel-name kns=conduit --print-limit 50 --error-exitcode 9 \
        python3 -m pytest -q -m gpu -p no:cacheprovider "$1" > "$work/racecheck_$name.log" 2>&1
    echo "racecheck $name rc=$? t=$SECONDS"
}
{ race tests/test_kernels.py; race tests/test_arena_properties.py; } &
{ race tests/test_decode_step.py; race tests/test_restore_batch.py; } &
{ race tests/test_prefill_graph.py; race tests/test_fused_pdl.py; race tests/test_topk.py; } &
wait
for log in "$work"/racecheck_*.log; do
    echo "== $(basename "$log")"; grep -E "SUMMARY|passed|failed|Internal Sanitizer" "$log" | tail -3
done
save
[ $SECONDS -lt 290 ] && timeout 100 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"
tail -24 "$work/bench.log"; save; echo "done t=$SECONDS"
