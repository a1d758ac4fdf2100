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
from conduit_rt.models import fused_triton

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


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
        torch.backends.cuda.preferred_blas_library("cublaslt")
        record("cublaslt", lambda: F.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublas")
        for block_n, block_k, warps in itertools.product((4, 8, 16), (1024, 2048, 4096), (4, 8, 16)):
            if block_n * block_k > 32768:
                continue
            label = f"triton n{block_n} k{block_k} w{warps}"
            try:
                record(label, lambda: fused_triton.gemv(x, w, block_n=block_n, block_k=block_k, num_warps=warps))
            except Exception as exc:  # a config that does not compile is just skipped
                print(label, "failed:", type(exc).__name__)
        for block_n, block_k, stages in itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 4, 6)):
            label = f"dot n{block_n} k{block_k} s{stages}"
            try:
                record(label, lambda: fused_triton.gemv_dot(x, w, block_n=block_n, block_k=block_k,
                                                            num_stages=stages))
            except Exception as exc:
                print(label, "failed:", type(exc).__name__)
        if name == "gate_up":  # the SiLU product fused into the epilogue, against linear + fused.silu_mul
            half = n_out // 2
            ref_silu = F.silu(F.linear(x, w[:half])) * F.linear(x, w[half:])
            for block_n, block_k in ((8, 1024), (8, 512), (4, 1024), (16, 512)):
                fn = lambda: fused_triton.gemv(x, w, silu_mul=True, block_n=block_n, block_k=block_k)
                err = ((fn().float() - ref_silu.float()).norm() / ref_silu.float().norm()).item()
                t = timer.device_time(fn).median_s
                rows[f"silu triton n{block_n} k{block_k}"] = {"us": t * 1e6, "gb_s": w.numel() * 2 / t / 1e9,
                                                             "rel_err": err}
            t = timer.device_time(lambda: fused_triton.silu_mul(*F.linear(x, w).chunk(2, dim=-1))).median_s
            rows["silu cublas+silu_mul"] = {"us": t * 1e6, "gb_s": w.numel() * 2 / t / 1e9, "rel_err": 0.0}
        best = max((k for k in rows if k.startswith("triton ")), key=lambda k: rows[k]["gb_s"])
        best_dot = max((k for k in rows if k.startswith("dot ")), key=lambda k: rows[k]["gb_s"])
        print(f"   best dot {rows[best_dot]['gb_s']:.0f} GB/s ({best_dot}, err {rows[best_dot]['rel_err']:.1e})")
        results["shapes"][name] = {"n_out": n_out, "n_in": n_in, "rows": rows, "best_triton": best}
        print(f"{name:8s} [{n_out}x{n_in}] cublas {rows['cublas']['gb_s']:.0f} GB/s, cublaslt "
              f"{rows['cublaslt']['gb_s']:.0f}, best triton {rows[best]['gb_s']:.0f} ({best}, "
              f"{rows[best]['of_copy']:.2f} of copy, err {rows[best]['rel_err']:.1e})")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
