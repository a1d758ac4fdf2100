#!/usr/bin/env bash
# Sixteenth session, call 46, on 06b682a+ (CONDUIT's scoring in one native call over every layer with
# the text pass's lse; numpy RoPE index): the warm request profiled as in call 45 (plus cProfile of
# the host), conduit bench, then the GPU tests. ~8 minutes.
set -uo pipefail
source tools/gpu_call.sh c46
cmake -S . -B /tmp/c46-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c46-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c46-build/libconduit.so
timeout 150 python3 tools/profile_ttft.py --out "$work/profile_ttft.json" --ttft 7 --timeline --full --cprofile 5 \
    --trace "$work/ttft_trace.json.gz" > "$work/profile_ttft.log" 2>&1; echo "profile rc=$? t=$SECONDS"; save
head -3 "$work/profile_ttft.log"
timeout 240 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; save
grep -E "TTFT|targets" "$work/bench/benchmarks.md" | head -4
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_gpu.log" 2>&1; echo "gpu tests rc=$? t=$SECONDS"
tail -3 "$work/tests_gpu.log"; save
