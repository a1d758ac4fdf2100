#!/usr/bin/env bash
# Fifteenth session, call 45 (the last ~4 device minutes, after three failed starts): racecheck with
# the default choice of warps on the kernel tests (call 43 forced 8), beside the other kernel-level
# files a process each (a file that reaches a cuBLAS half-precision GEMM stops there: call 44's
# probes). memcheck and synccheck ran whole-suite in call 43 on the same device code.
set -uo pipefail
source tools/gpu_call.sh c45
cmake -S . -B /tmp/c45-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c45-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c45-build/libconduit.so
race() {  # test file
    local name; name=$(basename "$1" .py)
    timeout 100 compute-sanitizer --tool racecheck --kernel-name kns=conduit --print-limit 50 --error-exitcode 9 \
        python3 -m pytest -q -m gpu -p no:cacheprovider "$1" > "$work/racecheck_$name.log" 2>&1
    echo "racecheck $name rc=$? t=$SECONDS $(grep -E '(passed|failed)' "$work/racecheck_$name.log" | tail -1)"
}
race tests/test_kernels.py &
for f in tests/test_restore_batch.py tests/test_decode_step.py tests/test_prefill_graph.py tests/test_arena_properties.py tests/test_fused_pdl.py; do
    race "$f" &
done
wait; save; echo "done t=$SECONDS"
