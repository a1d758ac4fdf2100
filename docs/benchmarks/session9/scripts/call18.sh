#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c18; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
timeout 420 python3 tools/ab_builds.py run --prefill --rounds 2 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$?"; tail -8 "$work/ab.log"
tar czf "$out/c18.tgz" -C "$work" .
CONDUIT_LIB=/tmp/ab-build-s2_lb3/libconduit.so timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_conduit.py > "$work/tests_s2_lb3.log" 2>&1; echo "tests s2_lb3 rc=$?"; tail -2 "$work/tests_s2_lb3.log"
tar czf "$out/c18.tgz" -C "$work" .
