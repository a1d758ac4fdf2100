#!/usr/bin/env bash
# Twelfth session, call 32: leave-one-out timing of the many-query attention's key loop (results of
# the probe builds are wrong by design; only their times are read): what each part costs.
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c32; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c32.tgz" -C "$work" .; }
SECONDS=0
timeout 380 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_probe.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -9 "$work/ab.log"; save
