#!/usr/bin/env bash
# Sixteenth session, call 48, on the stacked q/k/v product: its A/B (qkv_ab.py: the projections' device
# time, and untimed warm TTFTs with each form in one process), conduit bench, the GPU tests. ~6 minutes.
set -uo pipefail
source tools/gpu_call.sh c48
cmake -S . -B /tmp/c48-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c48-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c48-build/libconduit.so
timeout 150 python3 docs/benchmarks/session16/scripts/qkv_ab.py --out "$work/qkv_ab.json" > "$work/qkv_ab.log" 2>&1
echo "qkv ab rc=$? t=$SECONDS"; cat "$work/qkv_ab.log" | grep "^{" ; save
timeout 240 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; save
grep -E "^\| TTFT|^## Targets|^\| conduit, warm|^\| full prefill, warm|^Untimed" "$work/bench/benchmarks.md" | cut -c1-120
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_gpu.log" 2>&1
echo "gpu tests rc=$? t=$SECONDS"; tail -1 "$work/tests_gpu.log"; save
