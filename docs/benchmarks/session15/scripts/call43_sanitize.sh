#!/usr/bin/env bash
# Call 42 found: synccheck, the positions scan's __syncthreads reached from the producer's and the
# consumers' branches (fixed: cta_barrier_any_site); memcheck with torch's caching allocator off,
# only the CUDA-graph tests' cudaMalloc-while-capturing (and the topk tests after them, whose RNG
# state a failed capture left behind); racecheck, a hardware exception in the first model test and
# every test after it failed. This call: three lanes side by side on the one GPU, each of pytest
# processes under one tool, our kernels only (--kernel-name kns=conduit):
#   memcheck over the whole GPU suite (caching allocator on: the arena and the kernels' own buffers
#     are cudaMalloc'd by the library either way);
#   synccheck over the whole suite, then the kernel tests with the 8-warp kernels forced
#     (CONDUIT_MMA_WARPS=8: the producer ring on the small shapes too);
#   racecheck in groups (kernel tests with 8 warps, the other kernel-level files, the model-level
#     files), so that a crash is pinned to its group.
#   bash docs/benchmarks/session15/scripts/call43_sanitize.sh
set -uo pipefail
source tools/gpu_call.sh c43
cmake -S . -B /tmp/c43-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c43-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c43-build/libconduit.so
kernel_level="tests/test_topk.py tests/test_fused.py tests/test_fused_pdl.py tests/test_decode_step.py tests/test_restore_batch.py tests/test_prefill_graph.py tests/test_arena_properties.py"
sanitize() {  # log name, seconds, tool, pytest arguments...  (environment from the caller)
    local name="$1" limit="$2" tool="$3"; shift 3
    timeout "$limit" compute-sanitizer --tool "$tool" --kernel-name kns=conduit --print-limit 200 --error-exitcode 9 \
        python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$work/$name.log" 2>&1
    echo "$name rc=$? t=$SECONDS"
}
{ sanitize memcheck 430 memcheck tests/; } &
{ sanitize synccheck 300 synccheck tests/; CONDUIT_MMA_WARPS=8 sanitize synccheck_kernels_8warps 130 synccheck tests/test_kernels.py; } &
{ CONDUIT_MMA_WARPS=8 sanitize racecheck_kernels_8warps 170 racecheck tests/test_kernels.py
  sanitize racecheck_kernel_level 120 racecheck $kernel_level
  ignores=(); for f in tests/test_kernels.py $kernel_level; do ignores+=(--ignore "$f"); done
  sanitize racecheck_model_level 140 racecheck tests/ "${ignores[@]}"; } &
wait
for log in "$work"/*check*.log; do
    echo "== $(basename "$log")"; grep -E "SUMMARY|passed|failed|rror" "$log" | grep -v "Host Frame" | tail -4
done
save; echo "done t=$SECONDS"
