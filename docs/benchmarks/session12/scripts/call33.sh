#!/usr/bin/env bash
# Twelfth session, call 33: a TMA pipeline's handshakes without its copies (CONDUIT_PROBE_TMA_SYNC)
# against no copies and no barrier at all (probe builds: wrong outputs by design; only times are read).
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c33; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c33.tgz" -C "$work" .; }
SECONDS=0
timeout 250 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_tma_sync.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -9 "$work/ab.log"; save
