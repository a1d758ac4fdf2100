#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c25; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/gpu.txt"; nproc > "$work/nproc.txt"; lscpu | grep "Model name" >> "$work/nproc.txt"
timeout 200 python3 tools/ab_builds.py run --prefill --rounds 3 --out "$work/ab_prefill.json" > "$work/ab.log" 2>&1; echo "ab rc=$?"; tail -4 "$work/ab.log"
tar czf "$out/c25.tgz" -C "$work" .
# the faster of the two (sum of the rows' medians) is the one tested and benchmarked
pick=$(python3 -c "
import json,statistics as st
d=json.load(open('$work/ab_prefill.json'))['variants']
tot={n:sum(st.median(r[k] for r in v['rows_us']) for k in v['rows_us'][0]) for n,v in d.items()}
print(min(tot,key=tot.get))")
echo "picked $pick" | tee "$work/pick.txt"
export CONDUIT_LIB=/tmp/ab-build-$pick/libconduit.so
timeout 60 python3 .ab/wg_probe.py > "$work/probe.log" 2>&1; tail -2 "$work/probe.log"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$work/tests.log"
tar czf "$out/c25.tgz" -C "$work" .
timeout 200 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$?"; tail -24 "$work/bench.log"
tar czf "$out/c25.tgz" -C "$work" .
