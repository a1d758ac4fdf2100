#!/usr/bin/env bash
# Fourteenth session, call 38: the producer warpgroup without the positions' hand-over (cview, main's
# default build at 805aea4) tested, sanitized and benchmarked, then timed against the build without
# the producer (off) and the thirteenth session's lane-0 hand-over (arr-lane). Prepared here with
#   python3 tools/ab_builds.py prepare cview=HEAD off=HEAD+CONDUIT_MMA_PRODUCER=0 \
#       arr-lane=6335bb3+CONDUIT_MMA_PRODUCER=1+CONDUIT_PRODUCER_THREAD_ARRIVALS=0
set -uo pipefail
source tools/gpu_call.sh c38
stop=470
timeout 150 python3 tools/ab_builds.py run --prefill --rounds 0 --out "$work/ab_build.json" > "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"; tail -1 "$work/build.log"
export CONDUIT_LIB=/tmp/ab-build-cview/libconduit.so
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$work/tests_kernels.log" 2>&1; echo "kernels rc=$? t=$SECONDS"; tail -1 "$work/tests_kernels.log"; save
CONDUIT_MMA_WARPS=8 timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "(sdpa_reference or long_prefill_chunk) and cuda" > "$work/san_racecheck.log" 2>&1; echo "racecheck rc=$? t=$SECONDS"; grep -E "SUMMARY|passed|failed" "$work/san_racecheck.log" | tail -2; save
CONDUIT_MMA_WARPS=8 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk or sdpa_reference" > "$work/san_memcheck.log" 2>&1; echo "memcheck rc=$? t=$SECONDS"; grep -E "SUMMARY|passed|failed" "$work/san_memcheck.log" | tail -2; save
timeout 100 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; grep -E "prefill.vs_sdpa|recompute.vs_sdpa|ttft.vs" "$work/bench.log" | head -4; save
left=$((stop - SECONDS)); [ $left -gt 30 ] && { timeout $((left > 100 ? 100 : left)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_gpu.log" 2>&1; echo "gpu suite rc=$? t=$SECONDS"; tail -1 "$work/tests_gpu.log"; save; }
left=$((stop - SECONDS)); [ $left -gt 45 ] && { timeout $left python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -4 "$work/ab.log"; save; }
echo "done t=$SECONDS"
