#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c15; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
source tools/gpu_build.sh > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
save() { tar czf "$out/c15.tgz" -C "$work" .; }
for round in 1 2; do
  for v in base new; do
    if [ $v = base ]; then pp=$PWD/.ab/base_py; else pp=$PWD; fi
    PYTHONPATH=/tmp/site:$pp python3 .ab/ttft_ab.py $v 7 2>>"$work/ab.err" | tee -a "$work/ab.jsonl" | python3 -c "import json,sys;d=json.loads(sys.stdin.read());print(d['label'],d['conduit'],d['full'],d['conduit2'],d['ratio'])"
  done
done
save
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_conduit.py tests/test_runtime.py tests/test_compress.py tests/test_prefill_graph.py > "$work/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$work/tests.log"
save
timeout 120 python3 tools/profile_ttft.py --timeline --out "$work/timeline.json" > "$work/timeline.log" 2>&1; echo "timeline rc=$?"
grep -A40 "timeline" "$work/timeline.log" | head -60
save
