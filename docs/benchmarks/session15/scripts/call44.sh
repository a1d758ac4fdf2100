#!/usr/bin/env bash
# Fifteenth session, call 44:
# 1. A/B of the uneven split plan (mma_splits) against the one-wave plan, prepared here with
#      python3 tools/ab_builds.py prepare uneven=HEAD even=HEAD+env:CONDUIT_MMA_UNEVEN_SPLITS=0
# 2. racecheck beyond the kernel tests: call 43 lost the rest to a hardware exception in cuBLAS's
#    first bf16 GEMM (a kernel of ours neither ran nor was checked). Probes (one bf16 F.linear under
#    racecheck: with and without the kernel filter, with cuBLASLt preferred) pick a setting; the
#    kernel-level and model-level groups then run under it, beside the plain GPU suite.
# 3. conduit bench (alone on the GPU) on main.
set -uo pipefail
source tools/gpu_call.sh c44
cmake -S . -B /tmp/c44-build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a -DCONDUIT_CUDA=ON > "$work/build.log" 2>&1 \
    && cmake --build /tmp/c44-build -j 8 >> "$work/build.log" 2>&1 &
build=$!
timeout 200 python3 tools/ab_builds.py run --prefill --rounds 2 --out "$work/ab.json" > "$work/ab.log" 2>&1; echo "ab rc=$? t=$SECONDS"
tail -12 "$work/ab.log"; save
wait $build; echo "build rc=$? t=$SECONDS"
export CONDUIT_LIB=/tmp/c44-build/libconduit.so

gemm='import torch, torch.nn.functional as F
x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
y = F.linear(x, w); torch.cuda.synchronize(); print("gemm ok", float(y.float().abs().mean()))'
probe() {  # name, sanitizer options...  (environment from the caller)
    local name="$1"; shift
    timeout 90 compute-sanitizer --tool racecheck "$@" python3 -c "$gemm" > "$work/probe_$name.log" 2>&1
    grep -q "gemm ok" "$work/probe_$name.log" && echo "$name"
}
{ probe filter --kernel-name kns=conduit; probe whole; TORCH_BLAS_PREFER_CUBLASLT=1 probe filter_lt --kernel-name kns=conduit;
  TORCH_BLAS_PREFER_CUBLASLT=1 probe whole_lt; } > "$work/probes_ok.txt" &
probes=$!
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$work/tests_gpu.log" 2>&1; echo "gpu tests rc=$? t=$SECONDS"
tail -2 "$work/tests_gpu.log"
wait $probes; echo "probes passing: $(tr '\n' ' ' < "$work/probes_ok.txt") t=$SECONDS"; save

kernel_level="tests/test_topk.py tests/test_fused.py tests/test_fused_pdl.py tests/test_decode_step.py tests/test_restore_batch.py tests/test_prefill_graph.py tests/test_arena_properties.py"
ignores=(); for f in tests/test_kernels.py $kernel_level; do ignores+=(--ignore "$f"); done
pick=$(head -1 "$work/probes_ok.txt")
race_opts=(); race_env=()
case "$pick" in
    filter) race_opts=(--kernel-name kns=conduit) ;;
    filter_lt) race_opts=(--kernel-name kns=conduit); race_env=(TORCH_BLAS_PREFER_CUBLASLT=1) ;;
    whole_lt) race_env=(TORCH_BLAS_PREFER_CUBLASLT=1) ;;
esac
if [ -n "$pick" ]; then
    race() {  # name, seconds, pytest arguments...
        local name="$1" limit="$2"; shift 2
        env "${race_env[@]}" timeout "$limit" compute-sanitizer --tool racecheck "${race_opts[@]}" --print-limit 200 \
            --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$work/racecheck_$name.log" 2>&1
        echo "racecheck $name ($pick) rc=$? t=$SECONDS"
    }
    race kernel_level 190 $kernel_level &
    race model_level 190 tests/ "${ignores[@]}" &
    wait
    for log in "$work"/racecheck_*.log; do echo "== $(basename "$log")"; grep -E "SUMMARY|passed|failed" "$log" | tail -2; done
fi
save
timeout 120 python3 -m conduit_rt.bench --out "$work/bench" > "$work/bench.log" 2>&1; echo "bench rc=$? t=$SECONDS"
tail -25 "$work/bench.log"; save; echo "done t=$SECONDS"
