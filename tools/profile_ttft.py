#!/usr/bin/env python3
"""Where the time of a warm CONDUIT request goes, on a GPU: ``conduit bench``'s end-to-end setup
(LLaVA-1.5-7B-shaped random model, 8 images seen once), then its ``second`` request (the images
under a changed prefix and order, refresh conduit at 10%, one token) under torch.profiler. Prints
the wall time, the device-busy time, the host-side calls by self CPU time (CUDA runtime calls such
as cudaStreamSynchronize show where the host waits) and the kernels by device time.

With ``--timeline``, the request runs again under the profiler, and the device's idle time is laid
out along the request: from the request's start to its first kernel, every gap of at least
``--min-gap-us`` between kernels (each charged to the labelled function that launched the kernel
ending it: what the device waited for), and from the last kernel to the token on the host; with
each label's host time (calls, inclusive wall time). Labels: the request path's steps and arena
calls (``LABELLED``, wrapped in ``record_function`` for the run: cheap, so the host runs near its
real speed), or with ``--stacks`` every Python frame (a slower host: the gaps grow several-fold, and
the attribution is finer). The trace goes to ``--trace`` (chrome format, gzipped).

With ``--cprofile N``, N more warm requests run under cProfile (no torch profiler): the host's
Python functions by self time, per request, and the time the garbage collector took.

    python3 tools/profile_ttft.py [--out profile_ttft.json] [--ttft N] [--timeline [--stacks]] [--full]
        [--trace t.json.gz] [--cprofile N]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import gzip
import json
import os
import pstats
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from conduit_rt import arena, capture, decoding, planning, prefill_graph, refresh, request, reuse, sampling, topk

from conduit_rt.bench.config import E2ESizes
from conduit_rt.bench.e2e import EndToEnd
from conduit_rt.bench.timing import Timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="profile_ttft.json")
    parser.add_argument("--timeline", action="store_true", help="lay the device's idle gaps along the request")
    parser.add_argument("--stacks", action="store_true", help="label gaps by Python stacks (slow host)")
    parser.add_argument("--full", action="store_true", help="the timeline of the full-prefill request too")
    parser.add_argument("--min-gap-us", type=float, default=10.0)
    parser.add_argument("--trace", default=None, help="write the timeline run's chrome trace here (.json.gz)")
    parser.add_argument("--ttft", type=int, default=0, metavar="N",
                        help="first time N unprofiled warm requests of each kind, as conduit bench does (medians)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="N warm conduit requests under cProfile: host functions by self time")
    args = parser.parse_args()
    device = torch.device("cuda")
    e2e = EndToEnd(E2ESizes(), Timer(device), torch.bfloat16)
    e2e.request("first", e2e.first, refresh="conduit", max_tokens=1)  # the images become known
    for _ in range(2):  # warm-up: allocator, cuBLAS, Triton
        e2e.request("second", e2e.second, refresh="conduit", refresh_budget=0.1, max_tokens=1)
    torch.cuda.synchronize()
    unprofiled = ttft_medians(e2e, args.ttft) if args.ttft else None
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
    if unprofiled:
        summary["unprofiled_ttft_ms"] = unprofiled
    if args.timeline:
        runs = {"conduit": {"refresh": "conduit", "refresh_budget": 0.1}}
        if args.full:
            runs["full"] = {}
        for label, kwargs in runs.items():
            e2e.request("second", e2e.second, max_tokens=1, **kwargs)  # warm for this request kind
            trace = args.trace.replace(".json", f".{label}.json") if args.trace else None
            summary[f"timeline_{label}"] = timeline(e2e, kwargs, args.min_gap_us, trace, args.stacks)
            print_timeline(label, summary[f"timeline_{label}"])
    if args.cprofile:
        summary["cprofile"] = host_functions(e2e, args.cprofile)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wall {wall * 1e3:.1f} ms, ttft {result.stats.ttft_s * 1e3:.1f} ms, device busy {device_us / 1e3:.1f} ms")
    for r in rows:
        print(f"{r['self_cpu_ms']:8.2f} ms {r['calls']:6d} x  {r['name']}")
    print("device time by kernel:")
    for r in device_rows:
        print(f"{r['device_ms']:8.2f} ms {r['calls']:6d} x  {r['name']}")


def ttft_medians(e2e: EndToEnd, repeats: int) -> dict:
    """Median TTFT (ms) of ``repeats`` unprofiled warm requests: conduit at 10%, full prefill, conduit
    again (the spread between the two conduit rows is the drift of the machine)."""
    out = {}
    for label, kwargs in (("conduit", {"refresh": "conduit", "refresh_budget": 0.1}), ("full", {}),
                          ("conduit_again", {"refresh": "conduit", "refresh_budget": 0.1})):
        out[label] = e2e.ttft(label, e2e.second, repeats, **kwargs)["ttft_s"] * 1e3
    out["full_over_conduit"] = out["full"] / min(out["conduit"], out["conduit_again"])
    print("unprofiled TTFT (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return out


def host_functions(e2e: EndToEnd, repeats: int, top: int = 40) -> dict:
    """``repeats`` warm conduit requests under cProfile: the Python functions with the most self time
    (ms per request) and the garbage collector's time per request."""
    collected = [0.0, 0, 0.0]  # seconds, collections, start

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collected[2] = time.perf_counter()
        else:
            collected[0] += time.perf_counter() - collected[2]
            collected[1] += 1

    profiler = cProfile.Profile()
    gc.callbacks.append(on_gc)
    try:
        profiler.enable()
        for _ in range(repeats):
            e2e.request("second", e2e.second, refresh="conduit", refresh_budget=0.1, max_tokens=1)
        torch.cuda.synchronize()
        profiler.disable()
    finally:
        gc.callbacks.remove(on_gc)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, self s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    functions = [{"function": f"{os.path.basename(file)}:{line}:{name}", "calls": calls / repeats,
                  "self_ms": self_s * 1e3 / repeats, "cumulative_ms": cum_s * 1e3 / repeats}
                 for (file, line, name), (_, calls, self_s, cum_s, _) in rows]
    print(f"cProfile, per request ({repeats}): gc {collected[0] * 1e3 / repeats:.2f} ms in "
          f"{collected[1] / repeats:.1f} collections")
    for r in functions:
        print(f"{r['self_ms']:8.3f} ms self {r['cumulative_ms']:8.3f} ms cum {r['calls']:7.1f} x  {r['function']}")
    return {"requests": repeats, "gc_ms": collected[0] * 1e3 / repeats, "gc_collections": collected[1] / repeats,
            "functions": functions}


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# (owner, method) of the request path labelled in a timeline without --stacks
LABELLED = [(request.RequestReader, "read"), (planning.Planner, "plan"), (request.RequestReader, "embed"),
            (decoding.Decoder, "run"), (reuse.ReusePass, "run"), (reuse.ReusePass, "_restore"),
            (reuse.ReusePass, "_forward"), (reuse.ReusePass, "_pass"), (reuse.ReusePass, "_batch"),
            (capture.PassCapture, "on_layer"), (capture.PassCapture, "queries"), (reuse._PassScores, "attention"),
            (reuse._PassScores, "value_norms"), (refresh.Conduit, "select"), (refresh, "amplify"),
            (topk, "top_k_indices"), (arena.Sequence, "append"), (arena.Sequence, "write_kv"),
            (arena.Sequence, "attention"), (arena.Sequence, "attention_stats"), (arena.Sequence, "restore_images"),
            (prefill_graph.PrefillGraphs, "forward"), (torch.cuda.CUDAGraph, "replay"), (sampling.Sampler, "__call__")]


class _Labels:
    """Wraps LABELLED in record_function for a ``with`` block."""

    def __enter__(self) -> "_Labels":
        self.undo = []
        for owner, name in LABELLED:
            original = getattr(owner, name)
            label = f"{getattr(owner, '__name__', owner)}.{name}".replace("conduit_rt.", "")

            def wrapped(*a, _original=original, _label=label, **k):
                with record_function(_label):
                    return _original(*a, **k)

            setattr(owner, name, wrapped)
            self.undo.append((owner, name, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)


def timeline(e2e: EndToEnd, kwargs: dict, min_gap_us: float, trace_path: str | None, stacks: bool) -> dict:
    """One request under the profiler; its device-idle time by cause and its labels' host time (see
    the module docstring). Times in microseconds."""
    torch.cuda.synchronize()
    labels = contextlib.nullcontext() if stacks else _Labels()
    with labels, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks) as prof:
        host_start = time.perf_counter()
        result = e2e.request("second", e2e.second, max_tokens=1, **kwargs)
        host_ms = (time.perf_counter() - host_start) * 1e3
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    if trace_path:
        with gzip.open(trace_path, "wt") as f:
            json.dump({"traceEvents": events}, f)
    return idle_gaps(events, min_gap_us) | {"request_ms": host_ms, "ttft_ms": result.stats.ttft_s * 1e3}


def idle_gaps(events: list[dict], min_gap_us: float) -> dict:
    """The device's idle gaps of a chrome trace, each charged to the labels (user annotations, or
    the innermost ``conduit_rt`` Python frames) enclosing the launch that ended it; and each label's
    host time."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"),
                    key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    host = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime") and e.get("ph") == "X"]
    if not device or not host:
        return {"error": "no device or host events in the trace"}
    start = min(e["ts"] for e in host)
    end = max(e["ts"] + e["dur"] for e in host)
    frames = [e for e in events if e.get("cat") == "python_function" and e.get("ph") == "X"]
    annotations = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    stacks = _PythonStacks(frames) if frames else _PythonStacks(annotations, every_frame_ours=True)
    host_by_label = defaultdict(lambda: [0.0, 0])
    for e in annotations:
        host_by_label[e["name"]][0] += e["dur"]
        host_by_label[e["name"]][1] += 1
    # the launch of every device op, where there is one (a graph replay's kernels share their launch)
    launch_of = {id(e): launches.get(e.get("args", {}).get("correlation")) for e in device}
    where = stacks.at(sorted({(l["ts"], l["tid"]) for l in launch_of.values() if l is not None}))

    def cause(e: dict) -> str:
        launch = launch_of[id(e)]
        return where.get((launch["ts"], launch["tid"]), "?") if launch is not None else "?"

    gaps, by_cause = [], defaultdict(lambda: [0.0, 0])
    frontier = device[0]["ts"]
    lead = device[0]["ts"] - start
    for e in device:
        gap = e["ts"] - frontier
        if gap >= min_gap_us:
            by = cause(e)
            gaps.append({"at_us": frontier - start, "gap_us": gap, "next": e["name"][:60], "launched_by": by})
            by_cause[by][0] += gap
            by_cause[by][1] += 1
        frontier = max(frontier, e["ts"] + e["dur"])
    busy = sum(e["dur"] for e in device)
    causes = sorted(({"launched_by": k, "gap_us": v[0], "gaps": v[1]} for k, v in by_cause.items()),
                    key=lambda r: -r["gap_us"])
    return {"span_us": end - start, "device_busy_us": busy, "before_first_kernel_us": lead,
            "first_kernel_launched_by": cause(device[0]),
            "after_last_kernel_us": end - frontier, "gaps_total_us": sum(g["gap_us"] for g in gaps),
            "gaps_by_cause": causes[:25],
            "host_by_label": sorted(({"label": k, "host_us": v[0], "calls": v[1]} for k, v in host_by_label.items()),
                                    key=lambda r: -r["host_us"]), "largest_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:25]}


class _PythonStacks:
    """The Python frames (or labels) enclosing given host times, from a trace's properly nested
    python_function (or user_annotation) events: one sweep per thread."""

    def __init__(self, frames: list[dict], every_frame_ours: bool = False) -> None:
        self.every_frame_ours = every_frame_ours  # user annotations: every one is a label of ours
        self.by_thread: dict = defaultdict(list)
        for e in sorted(frames, key=lambda e: (e["ts"], -e["dur"])):
            self.by_thread[e["tid"]].append(e)

    def at(self, queries: list[tuple[float, object]]) -> dict:
        """{(t, tid): "innermost conduit_rt frames < ... | innermost frame"} for queries sorted by t."""
        out, cursor, stack = {}, defaultdict(int), defaultdict(list)
        for t, tid in queries:
            frames, i, open_ = self.by_thread.get(tid, []), cursor[tid], stack[tid]
            while i < len(frames) and frames[i]["ts"] <= t:
                while open_ and open_[-1]["ts"] + open_[-1]["dur"] < frames[i]["ts"]:
                    open_.pop()
                open_.append(frames[i])
                i += 1
            cursor[tid] = i
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] < t:
                open_.pop()
            enclosing = [e["name"] for e in open_ if e["ts"] + e["dur"] >= t]
            ours = [f for f in enclosing if self.every_frame_ours or "conduit_rt" in f or "/tools/" in f]
            label = " < ".join(_short(f) for f in reversed(ours[-3:]))
            inner = _short(enclosing[-1]) if enclosing else "?"
            out[(t, tid)] = f"{label} | {inner}" if label and enclosing[-1] not in ours[-1:] else (label or inner)
        return out


def _short(frame: str) -> str:
    """"/path/conduit_rt/reuse.py(123): run" -> "reuse.py:123 run"; builtins without their address."""
    if frame.startswith("<built-in"):
        return frame.split(" of ")[0].split(" at 0x")[0] + ">"
    if "(" not in frame:  # a label
        return frame
    location, _, function = frame.partition(": ")
    file, _, line = location.rpartition("(")
    return f"{os.path.basename(file)}:{line.rstrip(')')} {function}"


def print_timeline(label: str, t: dict) -> None:
    if "error" in t:
        print(f"timeline {label}: {t['error']}")
        return
    print(f"timeline {label}: span {t['span_us'] / 1e3:.1f} ms, device busy {t['device_busy_us'] / 1e3:.1f} ms, "
          f"before the first kernel {t['before_first_kernel_us'] / 1e3:.2f} ms ({t['first_kernel_launched_by']}), "
          f"gaps {t['gaps_total_us'] / 1e3:.2f} ms, after the last {t['after_last_kernel_us'] / 1e3:.2f} ms")
    for r in t["gaps_by_cause"][:15]:
        print(f"  {r['gap_us'] / 1e3:7.2f} ms {r['gaps']:5d} gaps  {r['launched_by']}")
    for r in t.get("host_by_label", [])[:25]:
        print(f"  host {r['host_us'] / 1e3:7.2f} ms {r['calls']:5d} calls  {r['label']}")


if __name__ == "__main__":
    main()
