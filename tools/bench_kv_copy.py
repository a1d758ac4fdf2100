#!/usr/bin/env python3
"""The arena's K/V copies against the copy bandwidth, on a GPU: the restore of a warm CONDUIT request
(``Sequence.restore_images``: 8 cached LLaVA images, 576 tokens each, every layer in one launch, K
rotated at new positions) and a prefill chunk's write (``Sequence.write_kv`` of 2048 tokens into
scattered slots, K rotated), in LLaVA-1.5-7B's KV shape (32 layers, 32 KV heads, head dim 128, bf16);
each also without the rotation (what the RoPE part costs).

Rates count bytes read + written, as the copy ceiling (``bench.ceilings.copy_bandwidth``) does. Each
row is the median of CUDA-event times over repeats, an L2-flushing write before each.

    python3 tools/bench_kv_copy.py [--repeats 20] [--out kv_copy.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from conduit_rt.arena import KVArena
from conduit_rt.bench import ceilings
from conduit_rt.bench.timing import Timer

LAYERS, KV_HEADS, HEAD_DIM, IMAGES, TOKENS_PER_IMAGE = 32, 32, 128, 8, 576


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="kv_copy.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = Timer(device)
    n_images = IMAGES * TOKENS_PER_IMAGE
    arena = KVArena(n_layers=LAYERS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=device,
                    block_size=16, kv_bytes=8 << 30, image_cache_bytes=3 << 30)
    arena.set_rope(1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    entries = []
    for i in range(IMAGES):
        entry = arena.create_image(bytes([i]) * 32, TOKENS_PER_IMAGE)
        for layer in range(LAYERS):
            entry.write(layer, *(torch.randn(TOKENS_PER_IMAGE, KV_HEADS, HEAD_DIM, device=device,
                                             dtype=torch.bfloat16) for _ in range(2)))
        entry.commit()
        entries.append(entry)
    prompt = n_images + 104  # the images after a short prefix, a question after them
    seq = arena.new_sequence()
    seq.append(range(prompt))
    slots = torch.arange(40, 40 + n_images)
    rope = (slots + 3).to(torch.int32).to(device)
    row_bytes = 2 * KV_HEADS * HEAD_DIM * 2  # K and V of one token in one layer
    restore = timer.device_time(lambda: seq.restore_images(entries, slots=slots, rope_pos=rope),
                                repeat=args.repeats)
    chunk = 2048
    k, v = (torch.randn(chunk, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2))
    chunk_slots = torch.randperm(prompt)[:chunk].sort().values.to(torch.int32).numpy()
    chunk_rope = torch.from_numpy(chunk_slots).to(device)
    write = timer.device_time(lambda: seq.write_kv(0, k, v, chunk_slots, rope_pos=chunk_rope),
                              repeat=args.repeats)
    restore_plain = timer.device_time(lambda: seq.restore_images(entries, slots=slots), repeat=args.repeats)
    write_plain = timer.device_time(lambda: seq.write_kv(0, k, v, chunk_slots), repeat=args.repeats)
    copy = ceilings.copy_bandwidth(timer, 2 << 30)["bytes_per_s"]
    restored, written = 2 * LAYERS * n_images * row_bytes, 2 * chunk * row_bytes
    rows = {"restore_8_images_32_layers": (restore, restored), "restore_without_rope": (restore_plain, restored),
            "write_kv_2048_scattered": (write, written), "write_kv_without_rope": (write_plain, written)}
    result = {"copy_bytes_per_s": copy, "rows": {}}
    for name, (timing, moved) in rows.items():
        seconds = timing.median_s
        result["rows"][name] = {"ms": seconds * 1e3, "bytes": moved, "bytes_per_s": moved / seconds,
                                "of_copy": moved / seconds / copy}
        print(f"{name:30s} {seconds * 1e3:8.3f} ms  {moved / seconds / 1e9:7.0f} GB/s  {moved / seconds / copy:5.2f} of copy")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
