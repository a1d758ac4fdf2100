#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c22; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
timeout 330 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$?"; tail -6 "$work/ab.log"
tar czf "$out/c22.tgz" -C "$work" .
CONDUIT_LIB=/tmp/ab-build-wg/libconduit.so timeout 60 python3 .ab/wg_probe.py 2>&1 | tail -5
CONDUIT_LIB=/tmp/ab-build-wg/libconduit.so timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/ > "$work/tests_wg.log" 2>&1; echo "tests wg rc=$?"; tail -15 "$work/tests_wg.log"
tar czf "$out/c22.tgz" -C "$work" .
