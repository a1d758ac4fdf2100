#!/usr/bin/env bash
# Thirteenth session, call 36: the producer with its positions read before the wait and its pool
# blocks at once (v2), copies unrolled by 8, 4 ring stages; against main. Then the kernel tests and
# memcheck of the fastest.
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c36; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c36.tgz" -C "$work" .; }
SECONDS=0
timeout 200 python3 tools/ab_builds.py run --prefill --rounds 0 --out "$work/ab_build.json" > "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"; tail -2 "$work/build.log"
for v in v2 v2-st4-u8; do
  CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk or sdpa_reference" > "$work/tk_$v.log" 2>&1; echo "tests $v rc=$? t=$SECONDS"; tail -1 "$work/tk_$v.log"
done
timeout 280 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -5 "$work/ab.log"; save
pick=$(python3 tools/ab_builds.py fastest "$work/ab_prefill.json"); echo "picked $pick" | tee "$work/pick.txt"
[ "$pick" = main ] && pick=v2
left=$((580 - SECONDS)); echo "left $left s"
if [ $left -gt 60 ]; then
  CONDUIT_LIB=/tmp/ab-build-$pick/libconduit.so timeout $((left - 50)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$work/tests_$pick.log" 2>&1; echo "kernels $pick rc=$? t=$SECONDS"; tail -1 "$work/tests_$pick.log"
fi
save
left=$((585 - SECONDS))
if [ $left -gt 25 ]; then
  CONDUIT_MMA_WARPS=8 CONDUIT_LIB=/tmp/ab-build-$pick/libconduit.so timeout $((left - 5)) compute-sanitizer --tool memcheck python3 .ab/wg_probe2.py > "$work/memcheck_$pick.log" 2>&1; echo "memcheck rc=$? t=$SECONDS"; tail -3 "$work/memcheck_$pick.log"
fi
save
