#!/usr/bin/env bash
# Fourteenth session, call 41: the many-query attention's split plan with the producer kernel: one
# wave of splits (the default) against two (CONDUIT_MMA_SPLIT_WAVES), which split the
# recompute shapes whose unsplit grid is 1-2 waves (wave quantization). Prepared here with
#   python3 tools/ab_builds.py prepare w1=HEAD w2=HEAD+env:CONDUIT_MMA_SPLIT_WAVES=2
set -uo pipefail
source tools/gpu_call.sh c41
timeout 170 python3 tools/ab_builds.py run --prefill --rounds 2 --out "$work/ab.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -5 "$work/ab.log"; save
echo "done t=$SECONDS"
