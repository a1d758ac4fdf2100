"""Replaying document-QA sessions on one Runtime: every setting answers the same request on the same
warmed image-KV store.

A session (``Replay.session``):
  1. forget the session's pages in the image-KV store (nothing left from an earlier session);
  2. warm: run the earlier requests in which the pages were seen (``sessions.seen_before``) as
     plain requests (``refresh=None``): each page is computed in that context and stored;
  3. answer the test request once per setting, greedily; the first setting is the reference, a
     cold full prefill (``refresh=None``: the store is not read, every token is computed; the
     prefix cache is off, so nothing else is reused either). Restoring reads the store and never
     writes it, and compression acts on the request's own sequence, so every setting sees the store
     exactly as the warm-up left it. Every answer is traced (``trace_selection``): the recall of the
     cells it needs (``recall``) is measured in what each setting refreshed and kept. A ``kv``
     setting (``--kv-dtype``) is the same cold full prefill on a second Runtime over the same
     model whose KV cache is stored in another format (fp8): what the format alone changes;
  4. forget the pages again.

The final hidden state is read by wrapping ``runtime.model.logits`` for the duration of a call
(it receives the last decoder layer's output, [n, hidden], before the final norm); the runtime is
not changed.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..preprocess import image_key, to_rgb_array
from .metrics import Outcome, SettingScores, fidelity, is_correct
from .recall import selection_measures

logger = logging.getLogger(__name__)

REFERENCE_KEY = "full_prefill"
TOGETHER_POLICIES = ("conduit", "vlcache")  # the combined row's refresh and compression policy by default


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the table: a refresh policy and budget, a compression policy and keep ratio, or both.

    ``kind``: "reference" (cold full prefill), "kv" (the same on the ``kv_dtype`` cache), "refresh",
    "compress" or "together".
    """

    kind: str
    refresh: str | None = None
    budget: float = 0.0
    compress: str | None = None
    keep: float = 1.0
    kv_dtype: str | None = None

    @property
    def key(self) -> str:
        if self.kind == "reference":
            return REFERENCE_KEY
        if self.kind == "kv":
            return f"{REFERENCE_KEY}+kv:{self.kv_dtype}"
        parts = []
        if self.refresh is not None:
            parts.append(f"refresh:{self.refresh}@{self.budget:g}")
        if self.compress is not None:
            parts.append(f"compress:{self.compress}@{self.keep:g}")
        return "+".join(parts)

    def generate_options(self) -> dict:
        """Keyword arguments of ``Runtime.generate`` for this setting."""
        return {"refresh": self.refresh, "refresh_budget": self.budget, "compress": self.compress, "keep": self.keep}


def build_settings(refresh_policies: Sequence[str], budgets: Sequence[float], compress_policies: Sequence[str],
                   keeps: Sequence[float], together: tuple[float, float] | None = (0.1, 0.1),
                   kv_dtype: str | None = None,
                   together_policies: tuple[str, str] = TOGETHER_POLICIES) -> list[Setting]:
    """The reference first, then (with ``kv_dtype``) the reference on that KV cache, each refresh
    policy at each budget, each compression policy at each keep ratio, and the combined row at
    ``together`` = (budget, keep) with the refresh and the compression policy of ``together_policies``
    (default CONDUIT and VL-Cache, the methods' own pair).

    Rows that would repeat another are run once: ``full`` (every token, any budget), ``none``
    (nothing, any budget), compression ``none`` (everything, any keep). Budget 0 is run only as
    ``none``: at budget 0 every refresh policy selects nothing and returns the text pass's logits
    (``reuse.ReusePass.run``), i.e. it is ``none``; the report shows ``none`` in that column.
    """
    settings = [Setting("reference")]
    if kv_dtype is not None:
        settings.append(Setting("kv", kv_dtype=kv_dtype))
    for policy in refresh_policies:
        if policy == "full":
            settings.append(Setting("refresh", "full", 1.0))
        elif policy == "none":
            settings.append(Setting("refresh", "none", 0.0))
        else:
            settings += [Setting("refresh", policy, float(b)) for b in budgets if b > 0]
    for policy in compress_policies:
        if policy == "none":
            settings.append(Setting("compress", compress="none", keep=1.0))
        else:
            settings += [Setting("compress", compress=policy, keep=float(k)) for k in keeps]
    if together is not None:
        refresh, compress = together_policies
        settings.append(Setting("together", refresh, float(together[0]), compress, float(together[1])))
    return settings


@contextlib.contextmanager
def recording_final_hidden(runtime) -> Iterator[list[torch.Tensor]]:
    """Yields a list that receives, for every ``model.logits`` call, the final norm's output of the
    last row: float32 [hidden] on the CPU. The model's own ``logits`` is restored on exit."""
    model = runtime.model
    original = model.logits
    norm = model.language_model.norm
    captured: list[torch.Tensor] = []

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(norm(hidden[-1:])[0].float().cpu())
        return original(hidden)

    model.logits = logits
    try:
        yield captured
    finally:
        del model.logits  # the instance attribute goes; the class method shows through again


class Replay:
    """Runs sessions on ``runtime`` (built with ``prefix_cache_entries=0`` and an image store large
    enough for a session's pages) for the given settings; ``max_tokens`` bounds each answer.
    ``kv_runtime``: the Runtime that answers the ``kv`` settings (over the same model, its KV cache
    in their ``kv_dtype``; also without a prefix cache)."""

    def __init__(self, runtime, settings: Sequence[Setting], max_tokens: int, kv_runtime=None) -> None:
        if settings[0].kind != "reference":
            raise ValueError("the first setting must be the reference (cold full prefill)")
        if kv_runtime is None and any(setting.kind == "kv" for setting in settings):
            raise ValueError("a kv setting needs a kv_runtime to answer it")
        for one in (runtime, kv_runtime):
            if one is not None and one.planner.prefix_cache.max_entries != 0:
                raise ValueError("the replay needs runtimes without a prefix cache (prefix_cache_entries=0)")
        self.runtime, self.kv_runtime, self.settings, self.max_tokens = runtime, kv_runtime, list(settings), max_tokens

    def session(self, messages: list[dict], seen: Sequence[list[dict]]) -> dict[str, Outcome]:
        """Warms the store with ``seen`` (earlier requests' messages), answers ``messages`` once per
        setting; returns the outcomes by setting key."""
        keys = self._image_keys([messages, *seen])
        self._forget(keys)
        try:
            for earlier in seen:
                self.runtime.generate(earlier, max_tokens=1)
            missing = [key for key in self._image_keys([messages]) if not self.runtime.arena.has_image(key)]
            if missing:
                raise RuntimeError(f"{len(missing)} page(s) of the request are not in the image-KV store after the "
                                   "warm-up: give the runtime a larger image_cache_bytes")
            return {setting.key: self._answer(messages, setting) for setting in self.settings}
        finally:
            self._forget(keys)

    def _answer(self, messages: list[dict], setting: Setting) -> Outcome:
        runtime = self.kv_runtime if setting.kind == "kv" else self.runtime
        with recording_final_hidden(runtime) as hidden:
            result = runtime.generate(messages, max_tokens=self.max_tokens, return_logits=True,
                                           trace_selection=True, **setting.generate_options())
        steps = result.logits.shape[0]  # the prefill's logits call, then one per decode step
        return Outcome(result.text, list(result.tokens), result.logits, torch.stack(hidden[-steps:]), result.stats)

    def _image_keys(self, conversations: Sequence[list[dict]]) -> list[bytes]:
        """The store keys of every image in the conversations (as the runtime computes them)."""
        assets = self.runtime.assets
        keys = []
        for messages in conversations:
            for message in messages:
                for part in message["content"]:
                    if isinstance(part, dict) and part.get("type") == "image":
                        keys.append(image_key(to_rgb_array(part["image"]), assets.preprocess.as_dict(),
                                              assets.vision_model_id))
        return list(dict.fromkeys(keys))

    def _forget(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if self.runtime.arena.has_image(key):
                self.runtime.arena.evict_image(key)


def stat_measures(outcome: Outcome) -> dict[str, float]:
    """Cost measures of one answer from its ``GenerationStats``."""
    s = outcome.stats
    return {
        "prefill_flops_ratio": float(s.prefill_flops_ratio),
        "kv_ratio": s.kv_bytes_after_compress / s.kv_bytes_before_compress if s.kv_bytes_before_compress else 1.0,
        "refreshed_fraction": s.refreshed_tokens / s.visual_tokens if s.visual_tokens else 0.0,
        "image_hit_rate": s.image_hits / s.images if s.images else 0.0,
        "ttft_s": float(s.ttft_s),
    }


@dataclass(slots=True)
class ReplayRequest:
    """What the replay needs of a test request: its messages, the ground truth, its page count, the
    messages of the earlier requests in which its pages were seen, its task family, and the image
    cells the answer reads ((image index, cell index) pairs: ``recall``; none: no recall measures)."""

    messages: list[dict]
    answer: str
    num_pages: int
    seen: list[list[dict]]
    family: str = "lookup"
    needed_cells: tuple[tuple[int, int], ...] = ()


def run_requests(replay: Replay, requests: Sequence[ReplayRequest], time_limit_s: float | None = None,
                 log_every: int = 10) -> tuple[dict[str, SettingScores], float]:
    """Replays the requests in order and scores every setting against the reference (fidelity, cost
    and the recall of the needed cells: ``recall.selection_measures``). Stops starting new sessions
    once ``time_limit_s`` has passed. Returns the scores by setting key and the seconds taken."""
    scores = {setting.key: SettingScores() for setting in replay.settings}
    start = time.perf_counter()
    for index, request in enumerate(requests):
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            logger.warning("time limit reached: %d of %d requests replayed", index, len(requests))
            break
        outcomes = replay.session(request.messages, request.seen)
        reference = outcomes[REFERENCE_KEY]
        for key, outcome in outcomes.items():
            scores[key].add(is_correct(outcome.text, request.answer), request.num_pages,
                            {**fidelity(reference, outcome), **stat_measures(outcome),
                             **selection_measures(request.needed_cells, outcome.stats)}, request.family)
        if (index + 1) % log_every == 0:
            logger.info("%d requests replayed in %.0f s; full prefill accuracy %.3f", index + 1,
                        time.perf_counter() - start, scores[REFERENCE_KEY].accuracy)
    return scores, time.perf_counter() - start
