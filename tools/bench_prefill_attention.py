#!/usr/bin/env python3
"""The many-query attention (prefill chunks, CONDUIT's passes) of the library at CONDUIT_LIB, on a GPU.

Shapes: ``conduit bench``'s prefill chunk (4096 causal queries, 32 heads over 8 KV heads; also at head
dim 64) and scattered recompute (884 queries over 8512 keys), and the LLaVA-7B (MHA, 32 KV heads) shapes of a warm CONDUIT
request: its text pass (104 queries after 4608 cached keys) and its recompute (461 scattered image
tokens + those 104). Each is timed (device time, median), checked against a float32 reference and
compared with torch SDPA on the dense causal problem of its size. Run it once per build to A/B
kernel variants; prints a table and writes --out.

    CONDUIT_LIB=/path/libconduit.so python3 tools/bench_prefill_attention.py --out prefill.json [--label X]
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from conduit_rt.bench.config import KernelSizes
from conduit_rt.bench.kernels import KernelBench
from conduit_rt.bench.timing import Timer

REQUEST_KEYS, REQUEST_TEXT, REQUEST_REFRESHED = 4712, 104, 461


def request_shapes() -> dict[str, list[int]]:
    """Query positions of a warm CONDUIT request's passes over REQUEST_KEYS keys."""
    generator = torch.Generator().manual_seed(5)
    visual = REQUEST_KEYS - REQUEST_TEXT
    text = list(range(visual, REQUEST_KEYS))
    chosen = torch.randperm(visual, generator=generator)[:REQUEST_REFRESHED].sort().values.tolist()
    return {"text pass (MHA)": text, "recompute (MHA)": chosen + text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_prefill_attention.json")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    timer = Timer(torch.device("cuda"))
    gqa = KernelBench(timer, KernelSizes(), torch.bfloat16)
    gqa64 = KernelBench(timer, dataclasses.replace(KernelSizes(), head_dim=64), torch.bfloat16)
    mha = KernelBench(timer, dataclasses.replace(KernelSizes(), n_kv_heads=32), torch.bfloat16)
    rows = {
        "prefill chunk 4K (GQA)": gqa.many_queries(4096, list(range(4096))),
        "bench recompute (GQA)": gqa.many_queries(*gqa.recompute_positions()),
        "prefill chunk 4K (GQA, d64)": gqa64.many_queries(4096, list(range(4096))),
    }
    for name, positions in request_shapes().items():
        rows[name] = mha.many_queries(REQUEST_KEYS, positions)
    print(f"{'shape':26s} {'queries':>7s} {'keys':>6s} {'ms':>8s} {'TFLOP/s':>8s} {'SDPA':>8s} {'rel err':>8s}")
    for name, r in rows.items():
        print(f"{name:26s} {r['n_queries']:7d} {r['n_keys']:6d} {r['seconds'] * 1e3:8.4f} "
              f"{r['flop_per_s'] / 1e12:8.1f} {r['sdpa_flop_per_s'] / 1e12:8.1f} {r['rel_err']:8.1e}")
    with open(args.out, "w") as f:
        json.dump({"label": args.label, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
