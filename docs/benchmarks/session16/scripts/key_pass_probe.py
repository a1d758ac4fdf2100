#!/usr/bin/env python3
"""CONDUIT's scoring call at the warm request's shape (LLaVA-7B: 32 KV heads, head_dim 128, bf16;
4712 keys, 85 query rows, 32 layers): device time of Sequence.attention_mass over every layer, and
per layer; K bytes read over the time. For ncu: --launches N runs the call N times and stops."""
import argparse
import json
import math

import torch

from conduit_rt.arena import KVArena

parser = argparse.ArgumentParser()
parser.add_argument("--launches", type=int, default=0)
parser.add_argument("--out", default=None)
args = parser.parse_args()
n, hk, d, nq, layers = 4712, 32, 128, 85, 32
arena = KVArena(n_layers=layers, n_kv_heads=hk, head_dim=d, dtype=torch.bfloat16, device="cuda", block_size=16,
                kv_bytes=4 << 30)
seq = arena.new_sequence()
seq.append(torch.arange(n, dtype=torch.int32))
for layer in range(layers):
    seq.write_kv(layer, torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16),
                 torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16))
q = torch.randn(layers, nq, hk, d, device="cuda", dtype=torch.bfloat16)
q_pos = torch.arange(n - nq, n, dtype=torch.int32, device="cuda")
scale = 1 / math.sqrt(d)
lse = torch.stack([seq.attention(layer, q[layer], q_pos, scale, return_lse=True)[1] for layer in range(layers)])
if args.launches:
    for _ in range(args.launches):
        seq.attention_mass(range(layers), q, q_pos, lse, scale)
    torch.cuda.synchronize()
    raise SystemExit(0)


def device_ms(fn, repeats=20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


every = device_ms(lambda: seq.attention_mass(range(layers), q, q_pos, lse, scale))
one = device_ms(lambda: seq.attention_mass([0], q[:1], q_pos, lse[:1], scale))
stats = device_ms(lambda: [seq.attention_stats(layer, q[layer], q_pos, scale) for layer in range(layers)])
k_bytes = n * hk * d * 2
result = {"all_layers_ms": every, "one_layer_ms": one, "stats_all_layers_ms": stats,
          "k_read_gbps_all_layers": layers * k_bytes / (every * 1e-3) / 1e9}
print(json.dumps(result))
if args.out:
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
