#!/usr/bin/env bash
# Source on a GPU machine: installs carried wheels (.whl/), builds the library for the local GPU and
# exports CONDUIT_LIB. Logs go to $OUT (or /tmp/conduit-gpu).
conduit_logs="${OUT:-/tmp/conduit-gpu}"; mkdir -p "$conduit_logs"  # (not `out`: a sourcing script may use that name)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# Hopper as 90a (wgmma: kernels/cuda/wgmma.cuh)
arch=$(python3 -c "import torch; p=torch.cuda.get_device_properties(0); print(f'{p.major}{p.minor}' + ('a' if p.major == 9 else ''))")
cmake -S . -B /tmp/conduit-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCONDUIT_CUDA=ON > "$conduit_logs/cmake.log" 2>&1 \
  && cmake --build /tmp/conduit-build >> "$conduit_logs/cmake.log" 2>&1 || { tail -50 "$conduit_logs/cmake.log"; return 1 2>/dev/null || exit 1; }
export CONDUIT_LIB=/tmp/conduit-build/libconduit.so
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$conduit_logs/gpu.txt"
