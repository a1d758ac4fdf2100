#!/usr/bin/env bash
set -uo pipefail
out="${OUT:-/tmp/conduit-gpu}"; work=/tmp/c20; rm -rf "$work"; mkdir -p "$out" "$work"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
source tools/gpu_build.sh > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
timeout 150 ncu --kernel-name regex:mma_attention_kernel --launch-skip 2 --launch-count 1 --set full python3 .ab/ncu_attn.py prefill > "$work/ncu_full_prefill.txt" 2>&1; echo "ncu rc=$?"
grep -iE "stall|Warp Cycles|Eligible|Issue Slots|Tensor|Shared|Bank|pipe" "$work/ncu_full_prefill.txt" | head -60
tar czf "$out/c20.tgz" -C "$work" .
