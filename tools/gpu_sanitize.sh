#!/usr/bin/env bash
# On a GPU machine: compute-sanitizer over the GPU tests, checking the library's kernels only
# (`--kernel-name kns=conduit`: every one lives in conduit::kernels::cuda; torch's run unchecked,
# which turns hours into minutes). Lanes side by side on the one GPU:
#   memcheck over the whole GPU suite; synccheck over it too, then over the kernel tests with the
#   8-warp kernels forced (CONDUIT_MMA_WARPS=8: the producer ring on the small shapes as well);
#   racecheck in two lanes, the kernel tests (8 warps forced, then the default choice) and the other
#   kernel-level files, a process each. Under a kernel filter racecheck dies on cuBLAS's
#   half-precision GEMMs (compute-sanitizer of CUDA 13 on an H200: one bf16 F.linear reproduces
#   it, and every test after it fails), and without the filter it reports races inside cuBLAS's
#   and cuDNN's own kernels and takes the model-level files far past an hour; so racecheck runs the
#   files whose GPU tests check our kernels against references, one process each, so that a file
#   reaching a half-precision GEMM loses only its own tests (its log shows "Internal Sanitizer
#   Error"). As of the sixteenth session (docs/benchmarks/runs.md, call 45) every file below runs whole
#   under it but the prefill-graph one, whose bf16 test reaches a GEMM (its float32 test runs).
# memcheck runs with torch's caching allocator on: a CUDA graph cannot be captured without it. The
# arena and the library's own buffers are its own cudaMalloc either way; the queries and outputs it
# gets from torch sit in torch's pool, where an overrun would stay inside an allocation (for those,
# PYTORCH_NO_CUDA_MEMORY_CACHING=1: the fifteenth session's call 42, 0 device errors, the graph
# tests failing to capture).
# Usage: tools/gpu_sanitize.sh [LOG-FOLDER [TOOL...]]  (folder default $OUT or /tmp/conduit-gpu; tools
# default memcheck synccheck racecheck; CONDUIT_LIB set, or source tools/gpu_build.sh first). Prints
# one summary per run; exit status 1 if any run failed.
set -uo pipefail
logs="${1:-${OUT:-/tmp/conduit-gpu}}"; mkdir -p "$logs"; shift $(( $# > 0 ? 1 : 0 ))
tools=" ${*:-memcheck synccheck racecheck} "
race_files=(tests/test_topk.py tests/test_decode_step.py tests/test_restore_batch.py tests/test_prefill_graph.py
            tests/test_fused_pdl.py)
check() {  # NAME TOOL SECONDS PYTEST-ARGS...  (environment from the caller)
    local name="$1" tool="$2" limit="$3"; shift 3
    timeout "$limit" compute-sanitizer --tool "$tool" --kernel-name kns=conduit --print-limit 100 --error-exitcode 9 \
        python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc $(grep -E '(passed|failed)' "$logs/$name.log" | tail -1) $(grep -E 'SUMMARY' "$logs/$name.log" | head -1 | sed 's/=* *//')"
    return $rc
}
lanes=()
if [[ $tools == *" memcheck "* ]]; then
    { check memcheck memcheck 420 tests/; } & lanes+=($!)
fi
if [[ $tools == *" synccheck "* ]]; then
    { check synccheck synccheck 300 tests/ && CONDUIT_MMA_WARPS=8 check synccheck_kernels_8warps synccheck 150 tests/test_kernels.py; } &
    lanes+=($!)
fi
if [[ $tools == *" racecheck "* ]]; then
    { CONDUIT_MMA_WARPS=8 check racecheck_kernels_8warps racecheck 200 tests/test_kernels.py \
        && check racecheck_kernels racecheck 200 tests/test_kernels.py; } & lanes+=($!)
    { failed=0
      for f in "${race_files[@]}"; do check "racecheck_$(basename "$f" .py)" racecheck 150 "$f" || failed=1; done
      exit $failed; } & lanes+=($!)
fi
status=0
for lane in "${lanes[@]}"; do wait "$lane" || status=1; done
exit $status
