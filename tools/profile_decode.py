#!/usr/bin/env python3
"""Where a decode step's time goes, on a GPU: the LLaVA-1.5-7B-shaped random model of ``conduit
bench``, a ``--context``-token prompt prefilled through the arena, then

- eager steps under torch.profiler: kernels per step and the top kernels by device time;
- the graph-replayed step (``GraphedDecoder``): device time per replay (CUDA events around replays
  only) and wall time per step (prepare + input fills + replay + a host sync, as the Runtime's loop);
- the bound: decoder weights + KV bytes read per token over the copy bandwidth;
- whether the Triton kernels ran with programmatic dependent launch (``pdl``; ``CONDUIT_PDL=0`` turns
  it off for them; the native decode kernels use it on every GPU that has it);
- with ``--trace``, where the replayed step's time goes: kernels traced in 8 replays, each credited
  with the time it extends the step past every kernel before it (``replay_critical``; kernels
  overlap under PDL, so their own durations do not add up), and the idle gaps before each;
- with ``--keep F``, the step of a VL-Cache-compressed sequence: after the prefill every layer keeps
  an evenly spaced F of the prompt's slots (the last one included), as ``Sequence.compact`` leaves it.

    python3 tools/profile_decode.py [--context 4096] [--steps 32] [--trace] [--keep F] [--out profile.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from conduit_rt.bench import ceilings, synthetic
from conduit_rt.bench.timing import Timer
from conduit_rt.decode_graph import GraphedDecoder
from conduit_rt.models import fused
from conduit_rt.models.base import ForwardBatch
from conduit_rt.models.random_init import random_llava


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--trace", action="store_true", help="credit the replayed step's time to its kernels")
    parser.add_argument("--keep", type=float, default=None, help="compact every layer to this fraction first")
    parser.add_argument("--out", default="profile_decode.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    text, vision = synthetic.llava_configs("llava-1.5-7b")
    model = random_llava(text, vision, device, torch.bfloat16, seed=0)
    n = args.context
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 2
    arena = model.new_arena(max(8 << 30, kv_per_token * (n + args.steps + 256)))
    seq = arena.new_sequence()
    seq.append(range(n))
    with torch.no_grad():
        ids = torch.randint(0, text.vocab_size, (n,), device=device)
        model.forward(seq, model.embed_tokens(ids), ForwardBatch.contiguous(0, n, device))
    if args.keep is not None:
        kept = torch.linspace(n - 1, 0, max(1, round(args.keep * n))).round().long().flip(0).unique()
        for layer in range(text.num_hidden_layers):
            seq.compact(layer, kept)
    torch.cuda.synchronize()

    rope_rows = (1,)
    position = n

    def eager_step() -> None:
        nonlocal position
        seq.append([position])
        pos = torch.full((1,), position, dtype=torch.int32, device=device)
        rope = torch.full(rope_rows, position, dtype=torch.int32, device=device)
        with torch.no_grad():
            model.logits(model.forward(seq, model.embed_tokens(ids[:1]), ForwardBatch(pos, rope)))
        position += 1

    for _ in range(3):
        eager_step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            eager_step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "cuda_time_total", 0) > 0]
    kernels = sorted(events, key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))
    top = [{"name": e.key[:90], "calls_per_step": e.count / 4,
            "us_per_step": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 4}
           for e in kernels[:25]]
    launches = sum(e.count for e in events) / 4

    decoder = GraphedDecoder(model, arena, capacity=n + args.steps + 64)
    with torch.no_grad():
        for _ in range(2):
            decoder.step(seq, 1, position, position)
            position += 1
        torch.cuda.synchronize()
        pairs = []
        start = time.perf_counter()
        for _ in range(args.steps):
            decoder._step.prepare([seq], [position])  # noqa: SLF001 (a profile of the step's parts)
            decoder._fill_inputs(1, position, position)  # noqa: SLF001
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            decoder._graph.replay()  # noqa: SLF001
            end.record()
            int(decoder._logits.argmax())  # noqa: SLF001 (the host sync of sampling)
            pairs.append((begin, end))
            position += 1
        wall = (time.perf_counter() - start) / args.steps
    replay_s = sorted(b.elapsed_time(e) / 1e3 for b, e in pairs)[len(pairs) // 2]
    critical = None
    if args.trace:
        replays = 8
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as traced:
            for _ in range(replays):
                decoder._step.prepare([seq], [position])  # noqa: SLF001
                decoder._fill_inputs(1, position, position)  # noqa: SLF001
                decoder._graph.replay()  # noqa: SLF001
                position += 1
            torch.cuda.synchronize()
        critical = critical_path(traced.events(), replays)

    copy = ceilings.copy_bandwidth(Timer(device), 2 << 30)["bytes_per_s"]
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if name.startswith("language_model") and "embed_tokens" not in name)
    kv_bytes = seq.nbytes
    result = {"context": n, "keep": args.keep, "eager_kernels_per_step": launches, "top_kernels": top,
              "graph_replay_device_s": replay_s, "graph_step_wall_s": wall,
              "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
              "copy_bytes_per_s": copy, "bound_s": (weight_bytes + kv_bytes) / copy,
              "pdl": fused._triton() is not None and fused._triton().pdl_enabled(torch.cuda.current_device()),
              "replay_critical": critical}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "top_kernels"}, indent=1))
    for row in top:
        print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f} x  {row['name']}")
    for row in critical or []:
        print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f} x  {row['name']}  (replay, critical)")


def critical_path(events, replays: int) -> list[dict]:
    """Per kernel name (and "idle before" it): the device time by which its launches extend the
    timeline past every kernel that started before them, per step. Sums to the traced span."""
    kernels = sorted((e for e in events if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start),
                     key=lambda e: e.time_range.start)
    totals: dict[str, list[float]] = {}
    frontier = kernels[0].time_range.start if kernels else 0.0
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        name = e.name[:90]
        if start > frontier:
            totals.setdefault(f"idle before {name}", [0.0, 0])[0] += start - frontier
        if end > frontier:
            row = totals.setdefault(name, [0.0, 0])
            row[0] += end - max(start, frontier)
            frontier = end
        totals.setdefault(name, [0.0, 0])[1] += 1
    rows = [{"name": name, "us_per_step": us / replays, "calls_per_step": n / replays}
            for name, (us, n) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


if __name__ == "__main__":
    main()
