#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c21; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader > "$work/gpu.txt"
timeout 330 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$?"; tail -6 "$work/ab.log"
tar czf "$out/c21.tgz" -C "$work" .
CONDUIT_LIB=/tmp/ab-build-br/libconduit.so timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_br.log" 2>&1; echo "tests br rc=$?"; tail -3 "$work/tests_br.log"
tar czf "$out/c21.tgz" -C "$work" .
