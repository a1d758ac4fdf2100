#!/usr/bin/env python3
"""Where the time of a warm CONDUIT request goes, on a GPU: ``conduit bench``'s end-to-end setup
(LLaVA-1.5-7B-shaped random model, 8 images seen once), then its ``second`` request (the images
under a changed prefix and order, refresh conduit at 10%, one token) under torch.profiler. Prints
the wall time, the device-busy time, the host-side calls by self CPU time (CUDA runtime calls such
as cudaStreamSynchronize show where the host waits) and the kernels by device time.

    python3 tools/profile_ttft.py [--out profile_ttft.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from conduit_rt.bench.config import E2ESizes
from conduit_rt.bench.e2e import EndToEnd
from conduit_rt.bench.timing import Timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="profile_ttft.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    e2e = EndToEnd(E2ESizes(), Timer(device), torch.bfloat16)
    e2e.request("first", e2e.first, refresh="conduit", max_tokens=1)  # the images become known
    for _ in range(2):  # warm-up: allocator, cuBLAS, Triton
        e2e.request("second", e2e.second, refresh="conduit", refresh_budget=0.1, max_tokens=1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = e2e.request("second", e2e.second, refresh="conduit", refresh_budget=0.1, max_tokens=1)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in averages)
    host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:30]
    rows = [{"name": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in host]
    kernels = sorted((e for e in averages if getattr(e, "self_device_time_total", 0) > 0),
                     key=lambda e: -e.self_device_time_total)[:30]
    device_rows = [{"name": e.key[:100], "calls": e.count, "device_ms": e.self_device_time_total / 1e3}
                   for e in kernels]
    summary = {"wall_ms": wall * 1e3, "ttft_ms": result.stats.ttft_s * 1e3, "device_busy_ms": device_us / 1e3,
               "top_host": rows, "top_device": device_rows}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wall {wall * 1e3:.1f} ms, ttft {result.stats.ttft_s * 1e3:.1f} ms, device busy {device_us / 1e3:.1f} ms")
    for r in rows:
        print(f"{r['self_cpu_ms']:8.2f} ms {r['calls']:6d} x  {r['name']}")
    print("device time by kernel:")
    for r in device_rows:
        print(f"{r['device_ms']:8.2f} ms {r['calls']:6d} x  {r['name']}")


if __name__ == "__main__":
    main()
