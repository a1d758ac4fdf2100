#!/usr/bin/env bash
# For the next session (call 45 could not start in the fifteenth: three failed starts spent its device
# time): racecheck through tools/gpu_sanitize.sh, the kernel tests with 8 warps forced and with the
# default choice, and the other kernel-level files a process each (a file that reaches a cuBLAS
# half-precision GEMM stops there: call 44's probes). memcheck and synccheck ran whole-suite in call
# 43 on the same device code. ~5 minutes.
set -uo pipefail
source tools/gpu_call.sh c45
cmake -S . -B /tmp/c45-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c45-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c45-build/libconduit.so
bash tools/gpu_sanitize.sh "$work" racecheck; echo "sanitize rc=$? t=$SECONDS"; save
