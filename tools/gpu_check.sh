#!/usr/bin/env bash
# On a GPU machine: build the library for this GPU, run the GPU-marked tests, keep logs in $OUT.
# Usage: tools/gpu_check.sh [pytest args...]   (wheels for cffi/pycparser/gguf in .whl/ if missing)
set -uo pipefail
source "$(dirname "$0")/gpu_build.sh" || exit 1
python3 -m pytest -q -m gpu tests/ -p no:cacheprovider "$@" 2>&1 | tee "${OUT:-/tmp/conduit-gpu}/pytest_gpu.log" | tail -40
