#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c26; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c26.tgz" -C "$work" .; }
SECONDS=0
timeout 260 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; tail -7 "$work/ab.log"; save
export CONDUIT_LIB=/tmp/ab-build-main/libconduit.so
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_main.log" 2>&1; echo "tests main rc=$? t=$SECONDS"; tail -3 "$work/tests_main.log"; save
for v in combo combo4 pv trim; do
  CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -x > "$work/tests_$v.log" 2>&1; echo "kernels $v rc=$? t=$SECONDS"; tail -1 "$work/tests_$v.log"
done; save
for tool in memcheck racecheck; do
  timeout 70 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "long_prefill_chunk and bfloat16" > "$work/san_$tool.log" 2>&1; echo "$tool rc=$? t=$SECONDS"; tail -3 "$work/san_$tool.log"
done; save
