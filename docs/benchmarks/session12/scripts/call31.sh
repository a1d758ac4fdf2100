#!/usr/bin/env bash
# Twelfth session, call 31: the decoupled key-tile loop (mbarriers, no CTA barrier a tile), with and
# without the warpgroups' ping-pong: correctness probes first (a hang is caught by timeouts), then A/B.
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c31; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c31.tgz" -C "$work" .; }
SECONDS=0
timeout 150 python3 tools/ab_builds.py run --prefill --rounds 0 --out "$work/ab_build.json" > "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"; tail -3 "$work/build.log"
for v in dec dec-pp dec-pp-late dec-pp-st4; do
  CONDUIT_MMA_WARPS=8 CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 40 python3 .ab/wg_probe2.py > "$work/probe_$v.log" 2>&1; echo "probe $v rc=$?"; cat "$work/probe_$v.log" | tail -3
  CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk or sdpa_reference" > "$work/tk_$v.log" 2>&1; echo "tests $v rc=$? t=$SECONDS"; tail -1 "$work/tk_$v.log"
done; save
timeout 330 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -8 "$work/ab.log"; save
pick=$(python3 tools/ab_builds.py fastest "$work/ab_prefill.json"); echo "picked $pick" | tee "$work/pick.txt"
left=$((585 - SECONDS)); echo "left $left s"
if [ $left -gt 50 ]; then
  CONDUIT_LIB=/tmp/ab-build-$pick/libconduit.so timeout $((left - 5)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$work/tests_$pick.log" 2>&1; echo "kernels $pick rc=$? t=$SECONDS"; tail -1 "$work/tests_$pick.log"
fi
save
