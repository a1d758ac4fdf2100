#!/usr/bin/env python3
"""Soak: many mixed requests on one Runtime (the bundled model, or a random-weight model of a
benchmark shape such as LLaVA-1.5-7B's; on the CPU or a GPU); memory and KV blocks must stay flat,
and a sample of answers must equal a fresh Runtime's.

The requests come from the quality task: 1-8 pages each (a third of them under new tags and order,
as an earlier session's pages come back), a refresh policy (None, conduit, none, full) and a
compression (None, vlcache), as one answer, a two-turn chat session, or a stream cancelled after a
piece or two (closed, or dropped for its finalizer to close); a third of the pages go as PNG bytes
(the decoded-image cache), the rest as PIL images. ``--threads`` serve them from several threads.

After ``--warmup`` requests, every ``--every`` requests it samples the process's RSS, the GPU memory
torch holds (on CUDA) and the arena's blocks in use (all, and those not in image entries), and fits
a line per quantity against the request count: the slopes (per request) are the result.

A sample of the requests (``--check``, a fraction) is built so that its answer cannot depend on what
ran before: a unique first line (no exact prefix to reuse), and, when it restores images, pages that
only such requests show, always filled alone (``fill="isolated"``, the same KV whoever fills them).
At the end a fresh Runtime answers the same sample one by one; every answer must be equal.

    python3 tools/soak.py --requests 10000 [--device cpu|cuda] [--threads 4] [--out soak.json]
    python3 tools/soak.py --model llava-1.5-7b --device cuda --requests 2000

``--model`` names the bundled model ("bundled") or a shape of ``conduit_rt/bench/synthetic.py``:
that model is built on the device with random weights (``models.random_init``), its word-level
tokenizer maps the task's words to one unknown id, and its answers always run to ``MAX_TOKENS``
(no EOS). The checked requests' unique first line is then made of filler words, which it knows.
The fresh Runtime of the check runs over the same weights (one copy on the device).

Prints the summary as JSON (the samples too, with ``--out``, which holds the slopes so far while
it runs); exits 1 on an error or a mismatch.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import conduit_rt
from conduit_rt import Runtime
from conduit_rt.evaluation.task.data import build_pool
from conduit_rt.evaluation.task.families import make_request
from conduit_rt.evaluation.task.generator import Ask, Question, retagged_request

SEED, SPLIT, PROBE_SPLIT, MAX_TOKENS = 5, "test", "val", 8
REFRESH = (None, "conduit", "conduit", "none", "full")
COMPRESS = (None, None, "vlcache")
MODES, MODE_WEIGHTS = ("answer", "session", "close", "drop"), (76, 8, 8, 8)
# the arena and image caches of a Runtime over a random-weight benchmark model
KV_CACHE_BYTES, IMAGE_CACHE_BYTES = 16 << 30, 4 << 30


@dataclass
class Spec:
    """One soak request: its pages and question (a quality-task request), how it is sent and asked."""

    index: int
    request: object
    options: dict
    mode: str
    png: bool
    marker: str | None = None  # a checked request's unique first line
    outcome: object = None
    pieces: int = 1

    def messages(self, pages: "PageImages") -> list[dict]:
        images = [pages.png(p) if self.png else pages.pil(p) for p in self.request.pages]
        messages = self.request.messages(images)
        if self.marker is not None:
            messages[0]["content"].insert(0, {"type": "text", "text": self.marker})
        return messages


@dataclass
class SoakModel:
    """How the soak makes its Runtimes: over the bundled model's files, or over one random-weight
    model of a benchmark shape (built once). ``marker`` gives a checked request's unique first line
    in words the model's tokenizer knows."""

    name: str
    device: str
    model: object = None
    fillers: range | None = None

    @classmethod
    def make(cls, name: str, device: str) -> "SoakModel":
        if name == "bundled":
            return cls(name, device)
        from conduit_rt.bench import synthetic, workload
        from conduit_rt.models.random_init import random_llava

        dev = torch.device(device)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        text, vision = synthetic.llava_configs(name)
        model = workload.never_stopping(random_llava(text, vision, dev, dtype, seed=0))
        return cls(name, device, model, synthetic.llava_vocabulary(text.vocab_size).fillers)

    def runtime(self) -> Runtime:
        if self.model is None:
            return Runtime(conduit_rt.BUNDLED_MODEL, device=self.device)
        return Runtime.from_model(self.model, kv_cache_bytes=KV_CACHE_BYTES, image_cache_bytes=IMAGE_CACHE_BYTES)

    def marker(self, index: int) -> str:
        if self.fillers is None:
            return f"{index} "
        n = len(self.fillers)
        return f"w{self.fillers[index % n]} w{self.fillers[index // n % n]} "


class PageImages:
    """Each page rendered once, as a PIL image and as PNG bytes."""

    def __init__(self) -> None:
        self._pil, self._png, self._lock = {}, {}, threading.Lock()

    def pil(self, page):
        with self._lock:
            if page.key not in self._pil:
                self._pil[page.key] = page.render()
            return self._pil[page.key]

    def png(self, page) -> bytes:
        image = self.pil(page)
        with self._lock:
            if page.key not in self._png:
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                self._png[page.key] = buffer.getvalue()
            return self._png[page.key]


def make_specs(count: int, check: float, pool_pages: int, marker=lambda index: f"{index} ") -> list[Spec]:
    """The soak's requests, deterministic from their index."""
    pool = build_pool(SEED, SPLIT, pool_pages).pages
    probes = build_pool(SEED, PROBE_SPLIT, 24).pages  # shown only by checked requests that restore
    specs = []
    for i in range(count):
        rng = random.Random(f"soak:{SEED}:{i}")
        options = dict(refresh=rng.choice(REFRESH), compress=rng.choice(COMPRESS))
        if options["compress"]:
            options["keep"] = rng.choice((0.25, 0.5))
        if options["refresh"] == "conduit" and rng.random() < 0.5:
            options["refresh_budget"] = rng.choice((0.05, 0.2))
        checked = rng.random() < check
        pages = probes if checked and options["refresh"] is not None else pool
        request = make_request(pages, PROBE_SPLIT if pages is probes else SPLIT, SEED, i, min_pages=1, max_pages=8)
        if rng.random() < 1 / 3:
            request = retagged_request(request, salt=i)
        mode = "answer" if checked else rng.choices(MODES, MODE_WEIGHTS)[0]
        specs.append(Spec(i, request, options, mode, png=rng.random() < 1 / 3, marker=marker(i) if checked else None,
                          pieces=rng.randint(1, 2)))
    return specs


def serve(rt: Runtime, spec: Spec, pages: PageImages) -> object:
    """Sends one spec; returns what a fresh Runtime must reproduce for a checked one."""
    messages = spec.messages(pages)
    if spec.mode == "answer":
        result = rt.generate(messages, max_tokens=MAX_TOKENS, **spec.options)
        return result.text, result.tokens
    if spec.mode == "session":
        chat = rt.chat()
        try:
            chat.send(messages[0]["content"], max_tokens=MAX_TOKENS, **spec.options)
            ask = Ask(0, spec.request.pages[0].colours[0])
            return chat.send(" " + spec.request.question_for(Question("code", (ask,))), max_tokens=MAX_TOKENS).text
        finally:
            chat.close()
    stream = rt.stream(messages, max_tokens=MAX_TOKENS, **spec.options)
    for _ in range(spec.pieces):
        if next(stream, None) is None:
            break
    if spec.mode == "close":
        stream.close()
    return None  # "drop": the stream goes with this frame


@dataclass
class Samples:
    """Quantities sampled along the soak (one row per sample)."""

    rows: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, rt: Runtime, done: int) -> None:
        with rt.lock:
            stats = rt.arena.stats()
        row = {"requests": done, "rss_bytes": rss_bytes(), "blocks_in_use": stats.n_blocks_used,
               "kv_blocks_in_use": stats.n_blocks_used - stats.n_blocks_image, "sequences": stats.n_seqs,
               "image_entries": stats.n_image_entries}
        if rt.device.type == "cuda":
            row["gpu_allocated_bytes"] = torch.cuda.memory_allocated(rt.device)
            row["gpu_reserved_bytes"] = torch.cuda.memory_reserved(rt.device)
        with self.lock:
            self.rows.append(row)

    def slopes(self) -> dict:
        rows = sorted(self.rows, key=lambda r: r["requests"])
        if len(rows) < 2:
            return {}
        x = np.array([r["requests"] for r in rows], dtype=np.float64)
        return {f"{name}_per_request": float(np.polyfit(x, np.array([r[name] for r in rows], dtype=np.float64), 1)[0])
                for name in rows[0] if name != "requests"}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(args: argparse.Namespace) -> dict:
    model = SoakModel.make(args.model, args.device)
    specs = make_specs(args.requests, args.check, args.pool, model.marker)
    pages = PageImages()
    rt = model.runtime()
    samples, errors = Samples(), []
    counter, counter_lock = iter(range(len(specs))), threading.Lock()
    done = [0]
    start = time.perf_counter()

    def worker() -> None:
        while True:
            with counter_lock:
                index = next(counter, None)
            if index is None:
                return
            spec = specs[index]
            try:
                spec.outcome = serve(rt, spec, pages)
            except Exception as error:  # noqa: BLE001 (counted and reported)
                errors.append(f"request {index}: {type(error).__name__}: {error}")
            with counter_lock:
                done[0] += 1
                finished = done[0]
            if finished % args.progress == 0:
                print(f"{finished} requests, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            if finished > args.warmup and finished % args.every == 0:
                samples.take(rt, finished)
                if args.out is not None:  # the slopes so far, in case the run is cut short
                    partial = {"partial": True, "requests_done": finished, "errors": len(errors),
                               "elapsed_s": round(time.perf_counter() - start, 1), "slopes": samples.slopes()}
                    args.out.write_text(json.dumps(partial, indent=1))

    threads = [threading.Thread(target=worker) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    rt.close()

    checked = [s for s in specs if s.marker is not None]
    with model.runtime() as fresh:
        mismatches = [s.index for s in checked if serve(fresh, s, pages) != s.outcome]
    return {
        "model": args.model, "device": str(rt.device), "requests": len(specs), "threads": args.threads, "warmup": args.warmup,
        "every": args.every, "elapsed_s": round(elapsed, 1), "errors": len(errors), "first_errors": errors[:5],
        "modes": {mode: sum(s.mode == mode for s in specs) for mode in MODES},
        "checked": len(checked), "mismatches": len(mismatches), "mismatched_requests": mismatches[:20],
        "slopes": samples.slopes(), "first_sample": min(samples.rows, key=lambda r: r["requests"], default=None),
        "last_sample": max(samples.rows, key=lambda r: r["requests"], default=None), "samples": samples.rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="bundled",
                        help="'bundled', or a shape of conduit_rt/bench/synthetic.py (random weights), e.g. llava-1.5-7b")
    parser.add_argument("--threads", type=int, default=1, help="threads sending requests to the one Runtime")
    parser.add_argument("--warmup", type=int, default=None, help="requests before the first sample (default 10%%)")
    parser.add_argument("--every", type=int, default=None, help="requests between samples (default 1%%)")
    parser.add_argument("--check", type=float, default=0.02, help="fraction of requests compared with a fresh Runtime")
    parser.add_argument("--pool", type=int, default=64, help="pages the unchecked requests draw from")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    parser.add_argument("--progress", type=int, default=100, help="requests between progress lines (stderr)")
    parser.add_argument("--out", type=Path, default=None, help="the summary with every sample, as JSON")
    args = parser.parse_args()
    args.warmup = args.requests // 10 if args.warmup is None else args.warmup
    args.every = max(1, args.requests // 100) if args.every is None else args.every
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    summary = soak(args)
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    sys.exit(1 if summary["errors"] or summary["mismatches"] else 0)


if __name__ == "__main__":
    main()
