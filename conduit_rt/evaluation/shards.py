"""Replaying the test requests in one process, or in several that share the device.

A replay is mostly Python and small kernels, so one process leaves a GPU idle; ``--workers W``
starts W processes (spawned), each with its own Runtime on the same device, and gives worker w the
requests w, w + W, w + 2W, ... (so that a time limit cuts every shard at about the same place).
Their per-setting scores are merged; every request is still scored against its own reference.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from .metrics import SettingScores
from .replay import Replay, ReplayRequest, Setting, run_requests

logger = logging.getLogger(__name__)


def split_requests(args: argparse.Namespace, indices: list[int]) -> list[ReplayRequest]:
    """Test-split requests ``indices`` with the messages of the earlier requests that saw their pages.
    Request ``index`` belongs to family ``args.families[index % len(args.families)]``."""
    from conduit_rt.evaluation.task.families import family_layout, make_request
    from conduit_rt.evaluation.task.generator import page_for

    from .sessions import request_messages, seen_before

    pools: dict[str, list] = {}
    out = []
    for index in indices:
        family = args.families[index % len(args.families)]
        layout = family_layout(family)
        if layout not in pools:
            pools[layout] = [page_for(args.seed, "test", page, layout) for page in range(args.pool_pages)]
        pool = pools[layout]
        request = make_request(pool, "test", args.seed, index, family=family, min_pages=args.min_pages,
                               max_pages=args.max_pages)
        out.append(ReplayRequest(request_messages(request), request.answer, request.num_pages,
                                 seen_before(request, pool, args.seen, salt=index), family,
                                 request.needed_cells))
    return out


def replay_shard(args: argparse.Namespace, model_path: Path, settings: list[Setting], indices: list[int],
                 device: torch.device, dtype: torch.dtype, progress: str | None = None) -> dict[str, SettingScores]:
    """One process's share: a Runtime of its own (and with ``args.kv_dtype`` a second one over the same
    weights, its KV cache in that dtype), the requests ``indices``, the scores by setting key.
    ``progress``: the label of a progress bar over the requests on stderr (None: no bar)."""
    from ..runtime import Runtime

    caches = {"kv_cache_bytes": args.kv_cache_mib << 20, "image_cache_bytes": args.image_cache_mib << 20,
              "prefix_cache_entries": 0}
    runtime = Runtime(model_path, device=device, dtype=dtype, **caches)
    # the same model object: the two answers differ in the KV format alone, and the weights are held once
    kv_runtime = Runtime.from_model(runtime.model, kv_dtype=args.kv_dtype, **caches) if args.kv_dtype else None
    replay = Replay(runtime, settings, args.max_tokens, kv_runtime)
    with tqdm(split_requests(args, indices), desc=progress, unit="request", disable=progress is None) as requests:
        scores, _ = run_requests(replay, requests, args.time_limit)
    return scores


def _start_worker(threads: int, level: int) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s[%(process)d]: %(message)s")
    logging.getLogger("conduit_rt.evaluation").setLevel(level)


def replay_all(args: argparse.Namespace, model_path: Path, settings: list[Setting], indices: list[int],
               device: torch.device, dtype: torch.dtype, progress: bool = False) -> tuple[dict[str, SettingScores], float]:
    """Scores of every setting over ``indices`` (in ``args.workers`` processes) and the wall seconds.
    ``progress``: a bar over the requests on stderr (with several workers, over the first one's share,
    which keeps pace with the others)."""
    start = time.perf_counter()
    workers = max(1, min(args.workers, len(indices)))
    if workers == 1:
        label = "eval" if progress else None
        return replay_shard(args, model_path, settings, indices, device, dtype, label), time.perf_counter() - start
    labels = [f"eval (worker 1 of {workers})" if progress else None] + [None] * (workers - 1)
    shards = [indices[w::workers] for w in range(workers)]
    threads = max(1, (os.cpu_count() or workers) // workers)
    level = logging.getLogger("conduit_rt.evaluation").getEffectiveLevel()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                             initargs=(threads, level)) as pool:
        parts = list(pool.map(replay_shard, *zip(*[(args, model_path, settings, shard, device, dtype, label)
                                                   for shard, label in zip(shards, labels)])))
    scores = {setting.key: SettingScores() for setting in settings}
    for part in parts:
        for key, value in part.items():
            scores[key].extend(value)
    return scores, time.perf_counter() - start
