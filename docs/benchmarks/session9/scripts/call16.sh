#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c16; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
[ -f /tmp/conduit-build/libconduit.so ] || source tools/gpu_build.sh > "$work/build.log" 2>&1
export CONDUIT_LIB=/tmp/conduit-build/libconduit.so
for round in 1 2 3; do
  for v in base new; do
    if [ $v = base ]; then pp=$PWD/.ab/base_py; else pp=$PWD; fi
    PYTHONPATH=/tmp/site:$pp python3 .ab/ttft_ab.py $v 9 2>>"$work/ab.err" >> "$work/ab.jsonl"; tail -1 "$work/ab.jsonl" | cut -c1-400
  done
done
tar czf "$out/c16.tgz" -C "$work" .
