#!/usr/bin/env bash
# Fourteenth session, call 40: the producer warpgroup at head dim 64 (a new row of
# tools/bench_prefill_attention.py), and 8-warp CTAs (which take the producer) for every row against
# the rule that gives the recompute 4. Prepared here with
#   python3 tools/ab_builds.py prepare on=HEAD off=HEAD+CONDUIT_MMA_PRODUCER=0 on-w8=HEAD+env:CONDUIT_MMA_WARPS=8
set -uo pipefail
source tools/gpu_call.sh c40
timeout 280 python3 tools/ab_builds.py run --prefill --rounds 2 --out "$work/ab.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -5 "$work/ab.log"; save
echo "done t=$SECONDS"
