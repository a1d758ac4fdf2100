#!/usr/bin/env bash
# Thirteenth session, call 34: the producer warpgroup (wg-producer) with 3 and 4 stages against main:
# correctness probes first (a hang is caught by timeouts), then the prefill A/B, then the kernel tests
# and racecheck of the fastest.
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c34; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c34.tgz" -C "$work" .; }
SECONDS=0
timeout 200 python3 tools/ab_builds.py run --prefill --rounds 0 --out "$work/ab_build.json" > "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"; tail -3 "$work/build.log"
for v in prod prod-st4; do
  CONDUIT_MMA_WARPS=8 CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 40 python3 .ab/wg_probe2.py > "$work/probe_$v.log" 2>&1; echo "probe $v rc=$?"; tail -3 "$work/probe_$v.log"
  CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk or sdpa_reference" > "$work/tk_$v.log" 2>&1; echo "tests $v rc=$? t=$SECONDS"; tail -1 "$work/tk_$v.log"
done; save
timeout 260 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -8 "$work/ab.log"; save
pick=$(python3 tools/ab_builds.py fastest "$work/ab_prefill.json"); echo "picked $pick" | tee "$work/pick.txt"
[ "$pick" = main ] && pick=prod
left=$((585 - SECONDS)); echo "left $left s"
if [ $left -gt 60 ]; then
  CONDUIT_LIB=/tmp/ab-build-$pick/libconduit.so timeout $((left - 40)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$work/tests_$pick.log" 2>&1; echo "kernels $pick rc=$? t=$SECONDS"; tail -1 "$work/tests_$pick.log"
fi
save
left=$((585 - SECONDS))
if [ $left -gt 30 ]; then
  CONDUIT_MMA_WARPS=8 CONDUIT_LIB=/tmp/ab-build-$pick/libconduit.so timeout $((left - 5)) compute-sanitizer --tool racecheck python3 .ab/wg_probe2.py > "$work/racecheck_$pick.log" 2>&1; echo "racecheck rc=$? t=$SECONDS"; tail -4 "$work/racecheck_$pick.log"
fi
save
