#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c19; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
source tools/gpu_build.sh > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
cp "$out/gpu.txt" "$work/" 2>/dev/null; nproc > "$work/nproc.txt"; lscpu | grep "Model name" >> "$work/nproc.txt"
save() { tar czf "$out/c19.tgz" -C "$work" .; }
step() {
    local name=$1; shift; local t0=$SECONDS
    "$@" > "$work/$name.log" 2>&1; local rc=$?; echo "== $name rc=$rc $((SECONDS - t0))s"; tail -${TAILN:-3} "$work/$name.log"; save
    return $rc
}
TAILN=6 step decode_files timeout 90 python3 .ab/decode_bench.py
TAILN=3 step gpu_tests timeout 170 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider
tests_rc=$?
if [ $tests_rc -eq 0 ]; then
  step bench timeout 170 python3 -m conduit_rt.bench --out "$work/bench"
  grep -E "^\| " "$work/bench/benchmarks.md" | head -40 | cut -c1-200 | grep -i "ttft\|conduit, warm\|full prefill, warm\|VL-Cache keep\|decode batch 1, 4096"
fi
