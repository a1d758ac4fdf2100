#!/usr/bin/env bash
# Fourteenth session, call 39: the producer publishing each tile's view (cview2: lane 0 writes and
# arrives, lane 0 of each consumer warp reads and shuffles) against main's consumers that vote for it
# themselves (cview), and with a ring of 5 stages; then the fastest tested, sanitized and benchmarked.
# Prepared here with
#   python3 tools/ab_builds.py prepare cview=main cview2=view-from-producer \
#       cview2-st5=view-from-producer+CONDUIT_PRODUCER_STAGES=5
set -uo pipefail
source tools/gpu_call.sh c39
stop=470
timeout 150 python3 tools/ab_builds.py run --prefill --rounds 0 --out "$work/ab_build.json" > "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"; tail -1 "$work/build.log"
timeout 150 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -4 "$work/ab.log"; save
best=$(python3 tools/ab_builds.py fastest "$work/ab.json"); echo "fastest: $best"
export CONDUIT_LIB=/tmp/ab-build-$best/libconduit.so
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$work/tests_kernels.log" 2>&1; echo "kernels rc=$? t=$SECONDS"; tail -1 "$work/tests_kernels.log"; save
CONDUIT_MMA_WARPS=8 timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "(sdpa_reference or long_prefill_chunk) and cuda" > "$work/san_racecheck.log" 2>&1; echo "racecheck rc=$? t=$SECONDS"; grep -E "SUMMARY|passed|failed" "$work/san_racecheck.log" | tail -2; save
CONDUIT_MMA_WARPS=8 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk or sdpa_reference" > "$work/san_memcheck.log" 2>&1; echo "memcheck rc=$? t=$SECONDS"; grep -E "SUMMARY|passed|failed" "$work/san_memcheck.log" | tail -2; save
timeout 100 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; grep -E "prefill.vs_sdpa|recompute.vs_sdpa|ttft.vs" "$work/bench.log" | head -4; save
left=$((stop - SECONDS)); [ $left -gt 30 ] && { timeout $((left > 100 ? 100 : left)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_gpu.log" 2>&1; echo "gpu suite rc=$? t=$SECONDS"; tail -1 "$work/tests_gpu.log"; save; }
echo "done t=$SECONDS"
