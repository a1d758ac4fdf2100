#!/usr/bin/env python3
"""The decode attention of the library at CONDUIT_LIB, on a GPU: ``conduit bench``'s decode rows alone.

Shapes: one query per sequence over 32K and 128K keys, 16 sequences of 8K (32 heads over 8 KV heads,
bf16, a ``DecodeStep`` as the runtime's decode), and LLaVA-7B's multi-head decode at a 4K context
(32 KV heads, the CUDA-core kernel). Each is timed (device time, median, L2 flushed), checked
against a float32 reference and compared with torch SDPA's fastest backend (``--no-sdpa``: ours only).
Decode figures differ between machines by as much as a kernel change moves them, so compare two
builds on one machine:

    CONDUIT_LIB=/path/a/libconduit.so python3 tools/bench_decode_attention.py --out a.json --label a
    CONDUIT_LIB=/path/b/libconduit.so python3 tools/bench_decode_attention.py --out b.json --label b
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from conduit_rt.bench.config import KernelSizes
from conduit_rt.bench.kernels import KernelBench
from conduit_rt.bench.timing import Timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_decode_attention.json")
    parser.add_argument("--label", default="")
    parser.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run, host clock)")
    parser.add_argument("--no-sdpa", action="store_true", help="time ours only (A/B runs of builds)")
    parser.add_argument("--sweep", type=int, nargs="*", default=[], metavar="N",
                        help="also one sequence of N keys, GQA and MHA (ours only), and a straight-line fit of "
                             "time against K+V bytes per kind: the fixed cost of a call and the streaming rate")
    args = parser.parse_args()
    timer = Timer(torch.device(args.device), repeat=20 if args.device == "cuda" else 1)
    gqa = KernelBench(timer, KernelSizes(), torch.bfloat16)
    mha = KernelBench(timer, dataclasses.replace(KernelSizes(), n_kv_heads=32), torch.bfloat16)
    compare = not args.no_sdpa
    rows = {
        "1 x 32K (GQA)": gqa.decode(32768, compare=compare),
        "1 x 128K (GQA)": gqa.decode(131072, compare=compare),
        "16 x 8K (GQA)": gqa.decode(8192, 16, compare=compare),
        "1 x 4K (MHA)": mha.decode(4096, compare=compare),
    }
    for n in args.sweep:
        rows[f"sweep 1 x {n} (GQA)"] = gqa.decode(n, compare=False)
        rows[f"sweep 1 x {n} (MHA)"] = mha.decode(n, compare=False)
    print(f"{'shape':16s} {'us':>8s} {'GB/s':>8s} {'SDPA us':>8s} {'backend':>8s} {'rel err':>8s}")
    for name, r in rows.items():
        timed = {k: v for k, v in r["sdpa"].items() if "seconds" in v}
        best = min(timed, key=lambda k: timed[k]["seconds"]) if timed else None
        sdpa_us = f"{timed[best]['seconds'] * 1e6:8.1f}" if best else f"{'-':>8s}"
        print(f"{name:16s} {r['seconds'] * 1e6:8.1f} {r['bytes_per_s'] / 1e9:8.0f} "
              f"{sdpa_us} {best or '-':>8s} {r['rel_err']:8.1e}")
    fits = {kind: fixed_cost_fit([r for name, r in rows.items() if name.startswith("sweep") and kind in name])
            for kind in ("GQA", "MHA")} if len(args.sweep) >= 2 else {}
    for kind, fit in fits.items():
        print(f"{kind}: time = {fit['fixed_us']:.1f} us + bytes / {fit['stream_gb_per_s']:.0f} GB/s")
    if fits:  # the same clock around one tiny kernel: the floor a single launch reads on this timer
        one = torch.ones(1, device=args.device)
        fits["one_tiny_kernel_us"] = timer.device_time(lambda: one.add_(1)).median_s * 1e6
        print(f"one tiny kernel: {fits['one_tiny_kernel_us']:.1f} us")
    with open(args.out, "w") as f:
        json.dump({"label": args.label, "rows": rows, "fits": fits}, f, indent=1, default=str)


def fixed_cost_fit(rows: list[dict]) -> dict:
    """Least squares of seconds against K+V bytes over the rows: the intercept (what a call costs
    before its first byte) and the slope's rate."""
    x = torch.tensor([float(r["kv_bytes"]) for r in rows], dtype=torch.float64)
    y = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    slope, intercept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), y[:, None]).solution.flatten().tolist()
    return {"fixed_us": intercept * 1e6, "stream_gb_per_s": 1 / slope / 1e9 if slope > 0 else float("inf")}


if __name__ == "__main__":
    main()
