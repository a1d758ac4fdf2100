#!/usr/bin/env python3
"""Decode-time matrix-vector products (one token) on a GPU: torch's F.linear (cuBLAS, and cuBLASLt)
against the Triton GEMV of ``fused_triton`` over a sweep of tile shapes, for the projections of a
LLaVA-1.5-7B-shaped decoder. Device time with the L2 flushed before each repeat (``Timer``); rates
as bytes of weight read per second and over the copy bandwidth measured in the same run.

    python3 tools/bench_gemv.py [--out gemv.json]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from conduit_rt.bench import ceilings
from conduit_rt.bench.timing import Timer
from conduit_rt.models import fused, fused_triton

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32064, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gemv.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = Timer(device, warmup=5, repeat=30)
    copy_bw = ceilings.copy_bandwidth(timer, 1 << 30)["bytes_per_s"]
    big = torch.ones(1 << 29, dtype=torch.bfloat16, device=device)
    read_bw = big.numel() * 2 / timer.device_time(lambda: big.sum(dtype=torch.float32)).median_s
    del big
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, read (sum) {read_bw / 1e9:.0f} GB/s")
    results = {"copy_bytes_per_s": copy_bw, "read_bytes_per_s": read_bw, "shapes": {}}
    torch.manual_seed(0)
    for name, (n_out, n_in) in SHAPES.items():
        w = torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, n_in, device=device, dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        rows = {}

        def record(label, fn, check=True):
            out = fn()
            err = ((out.float() - ref).norm() / ref.norm()).item() if check else float("nan")
            t = timer.device_time(fn).median_s
            rows[label] = {"us": t * 1e6, "gb_s": w.numel() * 2 / t / 1e9, "of_copy": w.numel() * 2 / t / copy_bw,
                           "rel_err": err}

        torch.backends.cuda.preferred_blas_library("cublas")
        record("cublas", lambda: F.linear(x, w))
        record("shipped (fused.linear)", lambda: fused.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        record("cublaslt", lambda: F.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublas")
        for block_n, block_k, warps in itertools.product((1, 2, 4), (2048, 4096, 8192), (2, 4, 8)):
            if block_n * block_k > 32768:
                continue
            label = f"triton n{block_n} k{block_k} w{warps}"
            try:
                record(label, lambda: fused_triton.gemv(x, w, block_n=block_n, block_k=block_k, num_warps=warps))
            except Exception as exc:  # a config that does not compile is just skipped
                print(label, "failed:", type(exc).__name__)
        best = max((k for k in rows if k.startswith("triton ")), key=lambda k: rows[k]["gb_s"])
        results["shapes"][name] = {"n_out": n_out, "n_in": n_in, "rows": rows, "best_triton": best}
        print(f"{name:8s} [{n_out}x{n_in}] cublas {rows['cublas']['gb_s']:.0f} GB/s, cublaslt "
              f"{rows['cublaslt']['gb_s']:.0f}, best triton {rows[best]['gb_s']:.0f} ({best}, "
              f"{rows[best]['of_copy']:.2f} of copy, err {rows[best]['rel_err']:.1e}); shipped "
              f"{rows['shipped (fused.linear)']['gb_s']:.0f}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
