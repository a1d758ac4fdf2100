#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c27; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"
save() { tar czf "$out/c27.tgz" -C "$work" .; }
SECONDS=0
timeout 250 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"; cat "$work/ab.log" | tail -8; save
# the fastest (sum of the rows' medians) is tested and benchmarked
pick=$(python3 -c "
import json,statistics as st
d=json.load(open('$work/ab_prefill.json'))['variants']
tot={n:sum(st.median(r[k] for r in v['rows_us']) for k in v['rows_us'][0]) for n,v in d.items()}
print(min(tot,key=tot.get))")
echo "picked $pick" | tee "$work/pick.txt"
export CONDUIT_LIB=/tmp/ab-build-$pick/libconduit.so
timeout 40 python3 .ab/wg_probe.py > "$work/probe.log" 2>&1; tail -2 "$work/probe.log"
for v in pipe pipe4; do
  CONDUIT_LIB=/tmp/ab-build-$v/libconduit.so timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -x > "$work/tests_$v.log" 2>&1; echo "kernels $v rc=$? t=$SECONDS"; tail -1 "$work/tests_$v.log"
done; save
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests.log" 2>&1; echo "tests $pick rc=$? t=$SECONDS"; tail -2 "$work/tests.log"; save
timeout 150 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; tail -22 "$work/bench.log"; save
