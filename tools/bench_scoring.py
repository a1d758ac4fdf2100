#!/usr/bin/env python3
"""attention_stats on the GPU: the tensor-core path against the CUDA-core one (CONDUIT_STATS_MMA=0).

For each path: one layer's device time at the bench's scoring shape (its heads, KV heads, head_dim and
query rows; keys at positions 0..n-1, the queries the last rows) for several key counts, each checked
against a float32 torch reference, and ``conduit bench``'s scoring section (all scoring layers plus the
selection, wall clock). The native library reads CONDUIT_STATS_MMA once, so each path runs in a child
process; the parent prints a table and writes both to --out.

    python3 tools/bench_scoring.py --out $OUT/bench_scoring.json [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from conduit_rt.bench.config import make_config
from conduit_rt.bench.kernels import KernelBench
from conduit_rt.bench.scoring import scoring
from conduit_rt.bench.timing import Timer

KEY_COUNTS = (4736, 8512)  # the real request's keys (~4.7K) and the bench's layout (128 + 8192 + 192)
THRESHOLD = 0.01


def reference(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """mass [n] and n_below [n_heads] in float32 from the explicit softmax; q [n_q, H, d], k [n, H_kv, d]."""
    group = q.shape[1] // k.shape[1]
    k_heads = k.float().repeat_interleave(group, dim=1)                        # [n, H, d]
    scores = torch.einsum("qhd,nhd->hqn", q.float(), k_heads) * scale           # [H, n_q, n]
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None].long()  # [n_q, n]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    below = (p < THRESHOLD * p.amax(dim=-1, keepdim=True)) & visible
    return p.sum(dim=(0, 1)), below.sum(dim=(1, 2)).float()


def layer_stats(bench: KernelBench, n: int) -> dict:
    s = bench.s
    arena = bench.arena(n)
    try:
        seq, ks, _ = bench.filled(arena, n)
        q = bench.randn(s.n_text_queries, s.n_heads, s.head_dim)
        q_pos = bench.positions(range(n - s.n_text_queries, n))
        timing = bench.timer.device_time(lambda: seq.attention_stats(0, q, q_pos, bench.scale, THRESHOLD))
        mass, n_below, _ = seq.attention_stats(0, q, q_pos, bench.scale, THRESHOLD)
        want_mass, want_below = reference(q, ks[0], q_pos, bench.scale)
    finally:
        arena.close()
    return {"n_keys": n, "seconds": timing.median_s, "time": timing.as_dict(),
            "mass_max_abs_err": float((mass - want_mass).abs().max()),
            "mass_max_rel_err": float(((mass - want_mass).abs() / want_mass.abs().clamp_min(1e-6)).max()),
            "below_max_abs_diff": float((n_below - want_below).abs().max()),
            "below_total": float(want_below.sum())}


def child(quick: bool) -> dict:
    config = make_config("cuda", quick)
    bench = KernelBench(Timer(config.device, config.warmup, config.repeat), config.kernels, config.dtype, seed=3)
    counts = KEY_COUNTS if not quick else (200, 500)
    return {"layer": [layer_stats(bench, n) for n in counts], "scoring": scoring(bench)}


def run_path(mma: bool, quick: bool) -> dict:
    env = {**os.environ, "CONDUIT_STATS_MMA": "1" if mma else "0"}
    cmd = [sys.executable, __file__, "--child"] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_scoring.json")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.quick)))
        return 0
    results = {"tensor_cores": run_path(True, args.quick), "cuda_cores": run_path(False, args.quick)}
    for path, r in results.items():
        for row in r["layer"]:
            print(f"{path:12s} one layer, {row['n_keys']:5d} keys: {row['seconds'] * 1e3:7.3f} ms  "
                  f"mass rel err {row['mass_max_rel_err']:.2e}  n_below off by {row['below_max_abs_diff']:.0f}")
        sc = r["scoring"]
        print(f"{path:12s} scoring, {sc['n_layers']} layers x {sc['n_keys']} keys + selection: {sc['seconds'] * 1e3:7.2f} ms")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
