#!/usr/bin/env bash
# Sixteenth session, call 50 (the last ~4 device minutes): the scoring key pass walking several key
# blocks per CTA with its rows resident, and without a branch around each exponential. The stats
# tests and the scoring probe with the walk on (default) and off (CONDUIT_KEY_PASS_WALK=0: one block
# per CTA, as before, with the branch-free code). ~2.5 minutes.
set -uo pipefail
source tools/gpu_call.sh c50
cmake -S . -B /tmp/c50-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c50-build -j 16 >> "$work/build.log" 2>&1; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c50-build/libconduit.so
for walk in 1 0 1; do
    CONDUIT_KEY_PASS_WALK=$walk timeout 40 python3 docs/benchmarks/session16/scripts/key_pass_probe.py \
        --out "$work/key_pass_walk$walk.json" >> "$work/key_pass.log" 2>&1
    echo "walk=$walk $(tail -1 "$work/key_pass.log") t=$SECONDS"
done
for walk in 1 0; do
    CONDUIT_KEY_PASS_WALK=$walk timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py \
        tests/test_conduit.py -k "attention_mass or attention_stats or cuda" > "$work/tests_walk$walk.log" 2>&1
    echo "tests walk=$walk rc=$? $(tail -1 "$work/tests_walk$walk.log") t=$SECONDS"
done
save
