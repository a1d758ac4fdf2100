#!/usr/bin/env bash
# Thirteenth session, call 37 (last device call): the producer warpgroup as it lands on main
# (arr-thread: every thread arrives on the barriers) tested, sanitized and benchmarked; the lane-0
# arrivals (arr-lane) against it last. Prepared here (on main, where the path is behind its switch) with
#   python3 tools/ab_builds.py prepare arr-thread=main+CONDUIT_MMA_PRODUCER=1 \
#       arr-lane=main+CONDUIT_MMA_PRODUCER=1+CONDUIT_PRODUCER_THREAD_ARRIVALS=0
# (this session it ran from the branch wg-producer, where the path was on, and the machine was taken
# back before anything came back; its prologue is tools/gpu_call.sh since).
set -uo pipefail
source tools/gpu_call.sh c37
stop=360
timeout 150 python3 tools/ab_builds.py run --prefill --rounds 0 --out "$work/ab_build.json" > "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"; tail -1 "$work/build.log"
export CONDUIT_LIB=/tmp/ab-build-arr-thread/libconduit.so
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$work/tests_kernels.log" 2>&1; echo "kernels rc=$? t=$SECONDS"; tail -1 "$work/tests_kernels.log"; save
CONDUIT_MMA_WARPS=8 timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "sdpa_reference and cuda and bfloat16" > "$work/san_racecheck.log" 2>&1; echo "racecheck rc=$? t=$SECONDS"; grep -E "SUMMARY|passed|failed" "$work/san_racecheck.log" | tail -2; save
timeout 100 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; grep -iE "prefill chunk|recompute|targets" "$work/bench.log" | head -6; save
left=$((stop - SECONDS)); [ $left -gt 30 ] && { timeout $((left > 95 ? 95 : left)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_gpu.log" 2>&1; echo "gpu suite rc=$? t=$SECONDS"; tail -1 "$work/tests_gpu.log"; save; }
left=$((stop - SECONDS)); [ $left -gt 40 ] && { CONDUIT_MMA_WARPS=8 timeout $((left > 45 ? 45 : left)) compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk or sdpa_reference" > "$work/san_memcheck.log" 2>&1; echo "memcheck rc=$? t=$SECONDS"; grep -E "SUMMARY|passed|failed" "$work/san_memcheck.log" | tail -2; save; }
left=$((stop - SECONDS)); [ $left -gt 45 ] && { timeout $left python3 tools/ab_builds.py run --prefill --rounds 2 --out "$work/ab_arrivals.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -3 "$work/ab.log"; save; }
echo "done t=$SECONDS"
