#!/usr/bin/env bash
# compute-sanitizer over the whole GPU suite, as issue 7 asks ("memcheck and racecheck clean on the
# GPU tests"), plus synccheck (barrier use: the positions scan's __syncthreads is reached from two
# warp-uniform call sites of the producer kernel). Written in the fourteenth session, run in the
# fifteenth with two changes that make a whole-suite run fit one call:
#   - `--kernel-name kns=conduit` checks our kernels only (every one lives in conduit::kernels::cuda);
#     torch's kernels run unchecked, which is what turns hours into minutes;
#   - the three tools run side by side, each a pytest process of its own on the one GPU.
# memcheck runs with torch's caching allocator off, so that every tensor is its own cudaMalloc and a
# read past a tensor's end lands outside any allocation instead of inside torch's pool.
# Run with `.whl` carried; builds the library with the repository's own CMake first.
#   bash docs/benchmarks/session15/scripts/call42_sanitize.sh [seconds per tool]
set -uo pipefail
source tools/gpu_call.sh c42
limit="${1:-420}"
cmake -S . -B /tmp/c42-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c42-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c42-build/libconduit.so
sanitize() {  # tool, extra environment...
    local tool="$1"; shift
    env "$@" timeout "$limit" compute-sanitizer --tool "$tool" --kernel-name kns=conduit --error-exitcode 9 \
        python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/san_$tool.log" 2>&1
    echo "$tool rc=$? t=$SECONDS"
}
sanitize memcheck PYTORCH_NO_CUDA_MEMORY_CACHING=1 &
sanitize racecheck &
sanitize synccheck &
wait
for tool in memcheck racecheck synccheck; do
    echo "== $tool"; grep -E "SUMMARY|passed|failed|error" "$work/san_$tool.log" | tail -4
done
save; echo "done t=$SECONDS"
