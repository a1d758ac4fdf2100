#!/usr/bin/env bash
# For the next session (not run in the fourteenth: its device time was spent): compute-sanitizer over
# the whole GPU suite, as issue 7 asks ("memcheck and racecheck clean on the GPU tests"), plus
# synccheck (barrier use: the positions scan's __syncthreads is reached from two warp-uniform call
# sites of the producer kernel). Each tool is one pytest run; a run cut by its timeout is kept.
# Run with `.whl` carried; builds the library with the repository's own CMake first.
#   bash docs/benchmarks/session14/scripts/call42_sanitize.sh [memcheck|racecheck|synccheck ...]
set -uo pipefail
source tools/gpu_call.sh c42
tools=("${@:-memcheck racecheck synccheck}")
cmake -S . -B /tmp/c42-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c42-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c42-build/libconduit.so
for tool in ${tools[@]}; do
    timeout 170 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ > "$work/san_$tool.log" 2>&1
    echo "$tool rc=$? t=$SECONDS"; grep -E "SUMMARY|passed|failed" "$work/san_$tool.log" | tail -2; save
done
echo "done t=$SECONDS"
