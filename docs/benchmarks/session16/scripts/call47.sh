#!/usr/bin/env bash
# Sixteenth session, call 47, on e49e2f4+ (call 46's scoring, plus the recompute's inputs embedded while
# the scoring runs, the raw stream pointer, no counter memset): the warm request profiled, conduit
# bench, then the GPU tests beside compute-sanitizer on the tests of the new kernel path; the scoring
# call at the request's shape (time and ncu). ~8 minutes.
set -uo pipefail
source tools/gpu_call.sh c47
cmake -S . -B /tmp/c47-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c47-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c47-build/libconduit.so
timeout 150 python3 tools/profile_ttft.py --out "$work/profile_ttft.json" --ttft 7 --timeline --full --cprofile 5 \
    --trace "$work/ttft_trace.json.gz" > "$work/profile_ttft.log" 2>&1; echo "profile rc=$? t=$SECONDS"; save
head -1 "$work/profile_ttft.log"
timeout 60 python3 docs/benchmarks/session16/scripts/key_pass_probe.py --out "$work/key_pass.json" > "$work/key_pass.log" 2>&1
echo "key pass rc=$? $(tail -1 "$work/key_pass.log")"
timeout 240 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"; save
grep -E "^\| TTFT|^## Targets" "$work/bench/benchmarks.md" | cut -c1-60
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_gpu.log" 2>&1 &
tests=$!
sel=(tests/test_kernels.py -k "attention_mass or attention_stats")
for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --kernel-name kns=conduit --print-limit 100 --error-exitcode 9 \
        python3 -m pytest -q -m gpu -p no:cacheprovider "${sel[@]}" > "$work/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E '(passed|failed)' "$work/$tool.log" | tail -1) $(grep SUMMARY "$work/$tool.log" | head -1)"
done
wait $tests; echo "gpu tests rc=$? t=$SECONDS"; tail -1 "$work/tests_gpu.log"; save
timeout 90 ncu --kernel-name regex:mma_key_stats --launch-skip 40 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
    python3 docs/benchmarks/session16/scripts/key_pass_probe.py --launches 3 > "$work/ncu_key_pass.txt" 2>&1
echo "ncu rc=$? t=$SECONDS"; save
