#!/usr/bin/env python3
"""The many-query attention (prefill chunks, CONDUIT's passes) of the library at CONDUIT_LIB, on a GPU.

Shapes: ``conduit bench``'s prefill chunk (4096 causal queries, 32 heads over 8 KV heads; also at head
dim 64) and scattered recompute (884 queries over 8512 keys), and the LLaVA-7B (MHA, 32 KV heads)
shapes of a warm CONDUIT request: its text pass (104 queries after 4608 cached keys) and its
recompute (461 scattered image tokens + those 104). Each is timed (device time, median), checked
against a float32 reference and compared with torch SDPA on the dense causal problem of its size;
prints a table and writes --out. ``--mma-warps`` and ``--mma-split-waves`` run it under a kernel
tuning (``conduit_tuning``): compare their rows with the defaults' to choose one for a GPU.

    CONDUIT_LIB=/path/libconduit.so python3 tools/bench_prefill_attention.py --out prefill.json [--label X]
        [--mma-warps 4|8] [--mma-split-waves N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from conduit_rt.arena import KernelTuning, KVArena
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


class TunedBench(KernelBench):
    """A KernelBench whose arenas carry a kernel tuning."""

    def __init__(self, timer: Timer, sizes: KernelSizes, dtype: torch.dtype, tuning: KernelTuning) -> None:
        super().__init__(timer, sizes, dtype)
        self.tuning = tuning

    def arena(self, n_tokens: int, n_seqs: int = 1, n_layers: int = 1) -> KVArena:
        with super().arena(n_tokens, n_seqs, n_layers) as plain:  # the bench's sizing, then the same arena tuned
            shape = dict(n_layers=plain.n_layers, n_kv_heads=plain.n_kv_heads, head_dim=plain.head_dim,
                         dtype=plain.dtype, device=plain.device, block_size=plain.block_size, kv_bytes=plain.kv_bytes)
        return KVArena(**shape, tuning=self.tuning)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_prefill_attention.json")
    parser.add_argument("--label", default="")
    parser.add_argument("--mma-warps", type=int, default=0, help="conduit_tuning.mma_warps (0: the default)")
    parser.add_argument("--mma-split-waves", type=int, default=0, help="conduit_tuning.mma_split_waves (0: the default)")
    args = parser.parse_args()
    tuning = KernelTuning(args.mma_warps, args.mma_split_waves)
    timer = Timer(torch.device("cuda"))
    gqa = TunedBench(timer, KernelSizes(), torch.bfloat16, tuning)
    gqa64 = TunedBench(timer, dataclasses.replace(KernelSizes(), head_dim=64), torch.bfloat16, tuning)
    mha = TunedBench(timer, dataclasses.replace(KernelSizes(), n_kv_heads=32), torch.bfloat16, tuning)
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
        json.dump({"label": args.label, "tuning": dataclasses.asdict(tuning), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
