"""What a request returns: the text, its tokens, optional per-step logits and typed statistics."""
from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from .locking import RequestLock


@dataclass(slots=True)
class GenerationStats:
    """What one request did and cost (times in seconds, sizes in bytes)."""

    ttft_s: float = 0.0                 # request start -> first token sampled
    prompt_tokens: int = 0
    prefill_tokens: int = 0             # prompt tokens after the exact prefix already in the arena
    reused_tokens: int = 0              # exact-prefix tokens whose KV was shared, nothing recomputed
    decode_tokens: int = 0              # tokens generated
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_s: float = 0.0
    images: int = 0
    image_hits: int = 0                 # images whose KV was reused (exact prefix or restored)
    image_misses: int = 0               # images whose KV was computed in this request
    image_disk_hits: int = 0            # of image_hits, images whose KV was loaded from the cache folder
    visual_tokens: int = 0              # restored visual tokens (N_vis), candidates for refresh
    refreshed_tokens: int = 0           # of those, recomputed
    recomputed_token_layers: int = 0    # token-layers of the recompute pass
    prefill_flops_ratio: float = 1.0    # prefill FLOPs / a full prefill of the same request
    kv_bytes: int = 0                   # arena bytes held by the request's sequence at the end
    kv_bytes_before_compress: int = 0   # the sequence's bytes after prefill, before compression
    kv_bytes_after_compress: int = 0    # ... and right after it (0: no compression)
    kept_tokens_per_layer: list[int] | None = None  # prompt tokens each layer kept
    finish_reason: str = ""             # "eos", "stop" or "length"
    # Where each image sits: per image (message order) the prompt positions [start, stop) of its
    # visual tokens, in the image's own token order (token j of image i is at start + j).
    image_spans: list[tuple[int, int]] | None = None
    # The selection trace (GenerationOptions.trace_selection; None without it), as prompt positions:
    restored_positions: list[int] | None = None         # the restored visual tokens (refresh's candidates), sorted
    refreshed_positions: list[list[int]] | None = None  # per decoder layer, the restored tokens recomputed
                                                        # there, sorted (None: no refresh policy)
    kept_positions: list[list[int]] | None = None       # per decoder layer, the prompt tokens compression kept
                                                        # for decoding, sorted (None: no compression)


@dataclass(slots=True)
class GenerationResult:
    """The answer: ``text``, its ``tokens``, per-step ``logits`` ([steps, vocab] float32, when asked)
    and ``stats``."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    logits: torch.Tensor | None = None


class TextStream:
    """Text pieces of an answer as they decode (iterate it); ``result`` once the stream is exhausted.

    The stream owns the generator that decodes: it yields the pieces and returns the
    ``GenerationResult``. ``close`` ends the answer early (the request's sequence is given back as
    for a finished one). With a ``lock`` (a Runtime's), each step of the generator runs holding it,
    and a stream dropped unfinished is closed under it (see ``locking``)."""

    def __init__(self, pieces: Generator[str, None, GenerationResult], lock: RequestLock | None = None) -> None:
        self._pieces = pieces
        self._result: GenerationResult | None = None
        self._lock, self._token = lock, None
        if lock is not None:
            self._token = lock.register(pieces)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        with self._holding():
            if self._lock is not None:
                self._lock.check_open()
            try:
                return next(self._pieces)
            except StopIteration as done:
                if self._result is None:
                    self._result = done.value
                self._done()
                raise
            except BaseException:  # the error ended the generator
                self._done()
                raise

    def close(self) -> None:
        with self._holding():
            self._pieces.close()
            self._done()

    def finish(self) -> GenerationResult:
        """Decodes the rest of the answer; returns the result."""
        for _ in self:
            pass
        return self.result

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished yet; iterate it to the end first")
        return self._result

    def __del__(self) -> None:
        if getattr(self, "_token", None) is not None:
            self._lock.abandon(self._token)

    def _holding(self) -> AbstractContextManager:
        return self._lock if self._lock is not None else nullcontext()

    def _done(self) -> None:
        if self._token is not None:
            self._lock.done(self._token)
            self._token = None
