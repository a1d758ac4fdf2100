#!/usr/bin/env bash
# Source at the top of a device-call script (run from the repository root on the GPU machine):
#   source tools/gpu_call.sh NAME
# Installs the carried wheels (.whl/: cffi, pycparser, gguf), puts them and the repository on
# PYTHONPATH, makes the work folder /tmp/NAME (emptied) and $out (the device tool's $OUT), records the
# GPU in $work/gpu.txt, defines save (tars $work into $out/NAME.tgz; call it after every step, since
# a call can be cut short) and starts SECONDS at 0.
call_name="${1:?usage: source tools/gpu_call.sh NAME}"
out="${OUT:-/tmp/conduit-gpu}"; work="/tmp/$call_name"; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/$call_name.tgz" -C "$work" .; }
SECONDS=0
