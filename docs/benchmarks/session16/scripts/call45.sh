#!/usr/bin/env bash
# Sixteenth session, call 45: the warm CONDUIT request profiled on main (kernels by device time and
# the labelled timeline of the device's idle gaps: where TTFT's 37.6 ms go now), then the racecheck
# the fifteenth session planned (tools/gpu_sanitize.sh racecheck: kernel tests with 8 warps forced
# and the default choice, the other kernel-level files a process each). ~7 minutes.
set -uo pipefail
source tools/gpu_call.sh c45
cmake -S . -B /tmp/c45-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c45-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c45-build/libconduit.so
python3 tools/profile_ttft.py --out "$work/profile_ttft.json" --ttft 7 --timeline --full \
    --trace "$work/ttft_trace.json.gz" > "$work/profile_ttft.log" 2>&1; echo "profile rc=$? t=$SECONDS"; save
bash tools/gpu_sanitize.sh "$work" racecheck; echo "sanitize rc=$? t=$SECONDS"; save
