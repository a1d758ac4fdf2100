"""The serve section: the server's scheduler (``serve.engine.Engine``) under concurrent clients, on
the end-to-end section's random-weight model (``workload``).

The engine is driven in-process, without HTTP: what is measured is the scheduler (admission,
prefill between decode steps, batched decode), not the web stack. Each client is a coroutine that
sends ``requests_per_client`` requests one after another, each waiting for the last one's answer;
every request shows the same ``n_images`` images (seen once before the runs) under a system prefix
and question of its own, with refresh "conduit" at the end-to-end section's ``refresh``.

  clients     for each client count: decode throughput (tokens generated / the run's wall time),
              TTFT p50 and p99 (arrival -> first token, queueing included) and the requests that did
              not come back whole (an error, or fewer tokens than asked)
  batch_step  ``scaling_clients`` requests prefilled, then the engine's own batched decode step
              (``engine.batch``, graph-captured on CUDA) over them, timed on the host with the
              device synchronized: tokens/s against the bandwidth bound of ``e2e.step_bound``
  restart     a Runtime with a cache folder computes the images (their files written), then
              answers a request over them (a warm in-memory hit) and closes; Runtimes started again
              over the folder, as ``conduit serve --cache-dir`` starts them (the folder's recent
              entries preloaded before the first request), answer the same request: TTFT against
              TTFT; one more restart without the preload loads the images on the request's path
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from conduit_rt.options import GenerationOptions
from conduit_rt.runtime import Runtime
from conduit_rt.serve.api_errors import ApiError
from conduit_rt.serve.engine import Engine, Job

from . import synthetic, workload
from .config import E2ESizes, ServeSizes
from .e2e import kv_bytes_per_token, step_bound, weight_bytes_per_token
from .stages import run_stages
from .targets import Target, at_least, at_most
from .timing import Timer

WARMUP_IMAGE_SEED = 20  # images of the warm-up requests, other than the measured ones (seed 10)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as its client saw it: answered whole (every token asked for), its TTFT (NaN
    when it failed) and the tokens it got."""

    whole: bool
    ttft_s: float
    tokens: int
    error: str = ""


class ServeBench:
    """The section's runs over one workload; ``runtime`` and ``engine`` serve the client runs and
    the batched step (``close`` frees them)."""

    def __init__(self, sizes: ServeSizes, e2e_sizes: E2ESizes, timer: Timer, dtype: torch.dtype) -> None:
        self.s, self.timer = sizes, timer
        self.work = workload.build(dataclasses.replace(e2e_sizes, n_images=sizes.n_images), timer.device, dtype)
        self.options = GenerationOptions(max_tokens=sizes.max_tokens, refresh="conduit",
                                         refresh_budget=e2e_sizes.refresh)
        self.runtime = self.new_runtime()
        self.engine = Engine(self.runtime, max_batch=sizes.max_batch, max_queue=max(sizes.clients))

    def new_runtime(self, cache_dir: Path | None = None) -> Runtime:
        return Runtime.from_model(self.work.model, kv_cache_bytes=self.s.kv_cache_bytes,
                                  image_cache_bytes=self.s.image_cache_bytes, cache_dir=cache_dir)

    def close(self) -> None:
        self.engine.stop()
        self.runtime.close()

    # -- concurrent clients ---------------------------------------------------------------------------
    def clients(self) -> dict:
        """Every client count of ``clients``: a short untimed run first (the decode step of its batch
        size is captured then), then the measured one."""
        self.runtime.generate(self.work.first, self.options)  # the images are seen before the runs
        self.engine.start()
        out = {}
        for n in self.s.clients:
            self.drive(n, 1, seed=1_000_000 + 1000 * n, max_tokens=min(2, self.s.max_tokens))
            out[str(n)] = summarize(self.drive(n, self.s.requests_per_client, seed=1000 * n))
        return out

    def drive(self, n_clients: int, per_client: int, seed: int, max_tokens: int | None = None) -> dict:
        """``n_clients`` clients sending ``per_client`` requests each (seeds from ``seed``); returns
        their outcomes and the run's wall time."""
        options = self.options if max_tokens is None else dataclasses.replace(self.options, max_tokens=max_tokens)
        plans = [[self.work.under_new_prefix(seed + per_client * c + k) for k in range(per_client)]
                 for c in range(n_clients)]
        start = time.perf_counter()
        outcomes = asyncio.run(self._all_clients(plans, options))
        return {"clients": n_clients, "outcomes": outcomes, "seconds": time.perf_counter() - start,
                "max_tokens": options.max_tokens}

    async def _all_clients(self, plans: list[list[list[dict]]], options: GenerationOptions) -> list[Outcome]:
        runs = await asyncio.gather(*(self._client(plan, options) for plan in plans))
        return [outcome for run in runs for outcome in run]

    async def _client(self, plan: list[list[dict]], options: GenerationOptions) -> list[Outcome]:
        """One client: each request of ``plan`` in turn, waiting for its answer."""
        loop, outcomes = asyncio.get_running_loop(), []
        for messages in plan:
            job = Job(messages, options, loop)
            try:
                self.engine.submit(job)
            except ApiError as error:
                outcomes.append(Outcome(False, math.nan, 0, error.message))
                continue
            outcomes.append(await _answer(job, options.max_tokens))
        return outcomes

    # -- the batched decode step ----------------------------------------------------------------------
    def batch_step(self) -> dict:
        """``scaling_clients`` requests prefilled, then ``max_tokens`` batched decode steps over them
        (two untimed first); tokens/s and the mean context the steps read."""
        n, steps = self.s.scaling_clients, self.s.max_tokens
        with self.runtime.lock:
            started = [self.runtime.start(self.work.under_new_prefix(5_000_000 + i), self.options) for i in range(n)]
            try:
                seqs = [s.seq for s in started]
                tokens = torch.stack([s.logits.argmax() for s in started])
                positions = [s.request.n_tokens for s in started]
                ropes = [s.request.next_rope for s in started]

                def step(i: int) -> torch.Tensor:
                    logits = self.engine.batch.step(seqs, tokens, [p + i for p in positions], [r + i for r in ropes])
                    return logits.argmax(-1)

                for i in range(2):
                    tokens = step(i)
                self.timer.sync()
                begin = time.perf_counter()
                for i in range(2, 2 + steps):
                    tokens = step(i)
                self.timer.sync()
                seconds = time.perf_counter() - begin
            finally:
                for s in started:
                    self.runtime.finish(s, None, whole=False)
        return {"batch": n, "steps": steps, "seconds": seconds, "tokens_per_s": n * steps / seconds,
                "mean_context": sum(positions) / n + 2 + steps / 2}

    # -- warm restart from the cache folder -----------------------------------------------------------
    def restart(self) -> dict:
        """TTFT of ``second`` on a Runtime that computed its images (in-memory hit, median of
        ``e2e.repeats``) against Runtimes started again over the cache folder as ``conduit serve``
        starts them: ``preload_images`` first (timed apart), then the request (median of
        ``restarts``); and once without the preload (the images loaded from disk on the request's
        path). Before its measured request each Runtime answers ``second``'s layout over other
        images, so all find the same one-time work (graph captures) done."""
        repeats = max(1, self.work.sizes.repeats)
        other = workload.requests(self.work.model, self.work.fillers, self.work.sizes, WARMUP_IMAGE_SEED)
        with tempfile.TemporaryDirectory(prefix="conduit-bench-cache-") as folder:
            with self.new_runtime(Path(folder)) as runtime:
                self._store(runtime, other.images)
                self._ttft(runtime, other.second)
                self._store(runtime, self.work.images)
                memory = [self._ttft(runtime, self.work.second) for _ in range(repeats)]
            restarted = []
            for _ in range(self.s.restarts):
                with self.new_runtime(Path(folder)) as runtime:
                    preload = self._preload(runtime)
                    self._ttft(runtime, other.second)
                    restarted.append(self._ttft(runtime, self.work.second) | preload)
            with self.new_runtime(Path(folder)) as runtime:
                self._ttft(runtime, other.second)
                on_demand = self._ttft(runtime, self.work.second)
        return {"in_memory": _median_run(memory), "restarted": _median_run(restarted), "on_demand": on_demand,
                "n_images": self.s.n_images}

    def _preload(self, runtime: Runtime) -> dict:
        """``runtime.preload_images()``, timed with the device synchronized."""
        self.timer.sync()
        start = time.perf_counter()
        loaded = runtime.preload_images()
        self.timer.sync()
        return {"preloaded": loaded, "preload_s": time.perf_counter() - start}

    def _store(self, runtime: Runtime, images: list) -> None:
        """Computes each image's KV in a request of its own and waits until its file is written (the
        store queues a bounded number of bytes, about one 7B image entry, and drops saves past it)."""
        s = self.work.sizes
        for i, image in enumerate(images):
            request = synthetic.image_request([image], s.prefix_words, s.question_words, self.work.fillers, i)
            runtime.generate(request, self.options, max_tokens=1)
            runtime.planner.image_kv.disk.flush()

    def _ttft(self, runtime: Runtime, messages: list[dict]) -> dict:
        runtime.planner.prefix_cache.clear()
        stats = runtime.generate(messages, self.options, max_tokens=1).stats
        return {"ttft_s": stats.ttft_s, "image_hits": stats.image_hits, "image_disk_hits": stats.image_disk_hits}


async def _answer(job: Job, max_tokens: int) -> Outcome:
    """Waits for ``job``'s last event."""
    while True:
        kind, value = await job.events.get()
        if kind == "done":
            return Outcome(len(value.tokens) == max_tokens, value.stats.ttft_s, len(value.tokens))
        if kind == "error":
            return Outcome(False, math.nan, 0, value.message)


def _median_run(runs: list[dict]) -> dict:
    """The run of median TTFT, with every TTFT beside it."""
    ordered = sorted(runs, key=lambda r: r["ttft_s"])
    return ordered[len(ordered) // 2] | {"samples_s": [r["ttft_s"] for r in ordered]}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100))


def summarize(run: dict) -> dict:
    """A client run's numbers: requests sent, lost, tokens/s over the run, TTFT p50 and p99."""
    outcomes: list[Outcome] = run["outcomes"]
    ttfts = [o.ttft_s for o in outcomes if o.whole]
    tokens = sum(o.tokens for o in outcomes)
    return {"clients": run["clients"], "requests": len(outcomes), "lost": sum(not o.whole for o in outcomes),
            "errors": sorted({o.error for o in outcomes if o.error})[:3], "tokens": tokens,
            "max_tokens": run["max_tokens"], "seconds": run["seconds"], "tokens_per_s": tokens / run["seconds"],
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def run(sizes: ServeSizes, e2e_sizes: E2ESizes, timer: Timer, dtype: torch.dtype,
        copy_bytes_per_s: float) -> tuple[dict, list[Target], dict[str, str]]:
    """Every serve run; returns (raw numbers, target rows, errors). A stage that raises is recorded
    in the errors and the later stages still run."""
    bench = ServeBench(sizes, e2e_sizes, timer, dtype)
    model = bench.work.model
    raw: dict = {"model": {"shape": e2e_sizes.shape, "weight_bytes_per_token": weight_bytes_per_token(model),
                           "kv_bytes_per_token": kv_bytes_per_token(model)}}
    stages: list[tuple[str, Callable[[], object]]] = [("clients", bench.clients), ("batch_step", bench.batch_step)]
    try:
        found, errors = run_stages("serve", stages)
    finally:
        bench.close()
    restart, restart_errors = run_stages("serve", [("restart", bench.restart)])
    raw.update(found | restart)
    if "batch_step" in raw:
        b, m = raw["batch_step"], raw["model"]
        b["bound_tokens_per_s"] = step_bound(copy_bytes_per_s, m["weight_bytes_per_token"], m["kv_bytes_per_token"],
                                             b["mean_context"], b["batch"])
    return raw, rows(raw, sizes), errors | restart_errors


def rows(raw: dict, sizes: ServeSizes) -> list[Target]:
    """The serve target rows whose stages ran."""
    out = []
    for build in (_client_rows, _step_rows, _restart_rows):
        try:
            out += build(raw, sizes)
        except KeyError:  # a stage it reads did not run (recorded in the errors)
            continue
    return out


def _client_rows(raw: dict, sizes: ServeSizes) -> list[Target]:
    runs = raw["clients"]
    one, many, most = runs[str(min(sizes.clients))], runs[str(sizes.scaling_clients)], runs[str(max(sizes.clients))]
    return [
        at_least("serve.throughput", f"serve: decode throughput, {many['clients']} clients vs {one['clients']}",
                 many["tokens_per_s"], one["tokens_per_s"], "tok/s", 8.0,
                 f"tokens/s at {many['clients']} clients / at {one['clients']}",
                 f"{sizes.requests_per_client} requests per client, {sizes.max_tokens} tokens each, {sizes.n_images} "
                 f"seen images under a new prefix; TTFT p50/p99 {many['ttft_p50_s'] * 1e3:.0f}/"
                 f"{many['ttft_p99_s'] * 1e3:.0f} ms vs {one['ttft_p50_s'] * 1e3:.0f}/{one['ttft_p99_s'] * 1e3:.0f} ms"),
        at_least("serve.no_loss", f"serve: requests answered whole at {most['clients']} clients",
                 float(most["requests"] - most["lost"]), float(most["requests"]), "requests", 1.0,
                 "requests answered whole / requests sent",
                 f"{most['lost']} lost; " + ("; ".join(most["errors"]) or "no errors")),
    ]


def _step_rows(raw: dict, sizes: ServeSizes) -> list[Target]:
    b = raw["batch_step"]
    return [at_least("serve.batch_step.vs_bound",
                     f"serve: batched decode step at batch {b['batch']}, ~{b['mean_context']:.0f}-token contexts: "
                     "tokens/s vs bound", b["tokens_per_s"], b["bound_tokens_per_s"], "tok/s", 0.85,
                     "our tokens/s / (batch x copy bandwidth / bytes read per step)",
                     "bytes: decoder weights once + every sequence's mean context KV")]


def _restart_rows(raw: dict, sizes: ServeSizes) -> list[Target]:
    r = raw["restart"]
    memory, restarted, on_demand = r["in_memory"], r["restarted"], r["on_demand"]
    return [at_most("serve.restart_ttft", "serve: TTFT after a restart over the cache folder vs a warm in-memory hit",
                    restarted["ttft_s"] * 1e3, memory["ttft_s"] * 1e3, "ms", 1.5,
                    "restarted TTFT / in-memory TTFT",
                    f"{restarted['preloaded']} image entries preloaded in {restarted['preload_s']:.2f} s before the "
                    f"first request, {restarted['image_hits']} of {r['n_images']} hits; median of "
                    f"{len(restarted['samples_s'])} restarts; without the preload (loaded from disk on the "
                    f"request's path) {on_demand['ttft_s'] * 1e3:.3g} ms",
                    valid=restarted["image_hits"] == r["n_images"] and restarted["preloaded"] >= r["n_images"]
                    and on_demand["image_disk_hits"] == r["n_images"])]
