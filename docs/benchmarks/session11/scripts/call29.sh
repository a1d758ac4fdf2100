#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c29; rm -rf "$work"; mkdir -p "$out" "$work"
save() { tar czf "$out/c29.tgz" -C "$work" .; }
SECONDS=0
OUT=$work source tools/gpu_build.sh; echo "built t=$SECONDS lib=$CONDUIT_LIB"; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
which cuobjdump; ls /usr/local/cuda/bin/cuobjdump 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k running_product -rs > "$work/sass_test.log" 2>&1; echo "sass test rc=$? t=$SECONDS"; tail -3 "$work/sass_test.log"
python3 tools/check_wgmma_sass.py "$CONDUIT_LIB" > "$work/sass_check.log" 2>&1; tail -1 "$work/sass_check.log"; save
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests.log" 2>&1; echo "tests rc=$? t=$SECONDS"; tail -2 "$work/tests.log"; save
timeout 120 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; tail -22 "$work/bench.log"; save
