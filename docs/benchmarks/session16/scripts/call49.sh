#!/usr/bin/env bash
# Sixteenth session, call 49, on main b4079b6 (the code of call 47): compute-sanitizer memcheck and
# synccheck over the whole GPU suite with the new scoring path (tools/gpu_sanitize.sh; racecheck of
# its kernels ran in call 47). ~5 minutes.
set -uo pipefail
source tools/gpu_call.sh c49
cmake -S . -B /tmp/c49-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c49-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c49-build/libconduit.so
bash tools/gpu_sanitize.sh "$work" memcheck synccheck; echo "sanitize rc=$? t=$SECONDS"; save
