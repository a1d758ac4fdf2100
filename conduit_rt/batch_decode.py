"""One decode step over several sequences at once: a token for each, one forward pass of the model.

The model runs over a native ``DecodeStep`` prepared with every sequence of the batch: the dense
layers see ``[n, hidden]`` rows, and each layer's attention is one call over all of them, each row
attending to its own sequence (conduit.h, "Decode steps"). On CUDA with graphs, the step is captured
once per batch-size bucket (powers of two up to the largest batch) and replayed, as
``decode_graph.GraphedDecoder`` does for one sequence: a batch smaller than its bucket is padded
with scratch sequences of one token, whose rows are computed and dropped. Elsewhere (the CPU, or
graphs off) the step runs eagerly over exactly the batch.
"""
from __future__ import annotations

import logging

import torch

from .arena import DecodeStep, KVArena, Sequence
from .decode_graph import capture_graph
from .errors import InvalidArgumentError
from .models.base import ForwardBatch

logger = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    """The batch sizes a step is captured for: powers of two below ``max_batch``, then ``max_batch``."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


class _Bucket:
    """A step object of ``size`` rows with static inputs and, once captured, its CUDA graph."""

    def __init__(self, model, arena: KVArena, size: int, capacity: int) -> None:
        device = arena.device
        self.size = size
        self.step: DecodeStep = arena.new_step(size, capacity, model.config.n_heads)
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.int32, device=device)
        rows = (3, size) if model.config.rope.sections else (size,)  # M-RoPE: t, h, w rows
        self.rope = torch.zeros(rows, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def fill(self, tokens: torch.Tensor, positions: list[int], rope_positions: list[int]) -> None:
        """The first len(positions) rows take the batch's inputs (tokens: int64 [n] on the device);
        padding rows keep what they hold."""
        n = len(positions)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.int32), non_blocking=True)
        rope = torch.tensor(rope_positions, dtype=torch.int32)
        self.rope[..., :n].copy_(rope if self.rope.dim() == 1 else rope.expand(3, n), non_blocking=True)

    def free(self) -> None:
        self.graph, self.logits = None, None
        self.step.free()


class BatchDecoder:
    """Decode steps of ``model`` over ``arena`` for batches of up to ``max_batch`` sequences.

    capacity: tokens per layer a step object holds for each sequence (it doubles when a sequence
    outgrows it). ``cuda_graphs``: on a CUDA arena, capture each bucket's step and replay it.
    """

    def __init__(self, model, arena: KVArena, max_batch: int, cuda_graphs: bool = True, capacity: int = 4096) -> None:
        if max_batch < 1:
            raise InvalidArgumentError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.arena, self.max_batch, self.capacity = model, arena, max_batch, capacity
        self.graphs = cuda_graphs and arena.device.type == "cuda"
        self._sizes = buckets(max_batch) if self.graphs else [max_batch]
        self._buckets: dict[int, _Bucket] = {}
        self._pads: list[Sequence] = []   # scratch sequences padding a batch to its bucket
        self._capture_failed = False
        self.replays = 0  # steps served by a graph replay

    def step(self, seqs: list[Sequence], tokens: torch.Tensor, positions: list[int],
             rope_positions: list[int]) -> torch.Tensor:
        """Appends token ``tokens[i]`` (int64 [n] on the device) at causal ``positions[i]`` and RoPE
        position ``rope_positions[i]`` to ``seqs[i]``; returns the next-token logits, float32
        [n, vocab], row i for sequence i (a tensor of its own: the next step does not overwrite it).

        Raises ArenaFullError when the arena has no block for a new token; then no sequence changed."""
        n = len(seqs)
        if not 1 <= n <= self.max_batch or len(positions) != n or len(rope_positions) != n:
            raise InvalidArgumentError(f"a step takes 1 to {self.max_batch} sequences with one position and RoPE "
                                       f"position each, got {n}, {len(positions)} and {len(rope_positions)}")
        longest = max(seq.max_tokens() for seq in seqs)
        if longest + 1 > self.capacity:
            self._grow(longest + 1)
        bucket = self._bucket(next(size for size in self._sizes if size >= n))
        if bucket.graph is None and self.graphs and not self._capture_failed:
            self._capture(bucket)
        if bucket.graph is None:  # eager, over exactly the batch
            bucket.step.prepare(seqs, positions)
            return self._forward(bucket.step, tokens, *self._inputs(positions, rope_positions))
        pads = self._padding(bucket.size - n)
        bucket.step.prepare(list(seqs) + pads, list(positions) + [0] * len(pads))
        bucket.fill(tokens, positions, rope_positions)
        bucket.graph.replay()
        self.replays += 1
        return bucket.logits[:n].clone()

    def close(self) -> None:
        """Drops the graphs and frees the step objects and the scratch sequences."""
        for bucket in self._buckets.values():
            bucket.free()
        self._buckets.clear()
        for pad in self._pads:
            pad.free()
        self._pads.clear()

    def _bucket(self, size: int) -> _Bucket:
        if size not in self._buckets:
            self._buckets[size] = _Bucket(self.model, self.arena, size, self.capacity)
        return self._buckets[size]

    def _forward(self, step: DecodeStep, tokens: torch.Tensor, positions: torch.Tensor,
                 rope: torch.Tensor) -> torch.Tensor:
        """The work of a prepared step: tokens int64 [n], positions int32 [n], RoPE positions int32
        [n] or [3, n] -> logits [n, vocab] float32."""
        embeds = self.model.embed_tokens(tokens)
        return self.model.logits(self.model.forward(step, embeds, ForwardBatch(positions=positions, rope_positions=rope)))

    def _inputs(self, positions: list[int], rope_positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal positions int32 [n] and RoPE positions int32 [n] or [3, n] (M-RoPE: a decoded
        token has the same t, h and w position) on the device."""
        device = self.arena.device
        rope = torch.tensor(rope_positions, dtype=torch.int32)
        if self.model.config.rope.sections:
            rope = rope.expand(3, len(rope_positions)).contiguous()
        return (torch.tensor(positions, dtype=torch.int32).to(device, non_blocking=True),
                rope.to(device, non_blocking=True))

    def _padding(self, count: int) -> list[Sequence]:
        """``count`` scratch sequences, emptied: the step appends their one token at position 0."""
        while len(self._pads) < count:
            self._pads.append(self.arena.new_sequence())
        pads = self._pads[:count]
        for pad in pads:
            pad.truncate(0)
        return pads

    def _capture(self, bucket: _Bucket) -> None:
        """Warms up on scratch sequences (one token each at position 0), then records the bucket's
        step over all its rows. The recording runs nothing; the step is prepared with the real batch
        before every replay."""
        pads = self._padding(bucket.size)

        def prepare() -> None:
            bucket.step.prepare(pads, [0] * bucket.size)
            bucket.fill(torch.zeros(bucket.size, dtype=torch.long, device=self.arena.device),
                        [0] * bucket.size, [0] * bucket.size)

        try:
            bucket.graph, bucket.logits, self._capture_failed = capture_graph(
                prepare, lambda: self._forward(bucket.step, bucket.tokens, bucket.positions, bucket.rope),
                self.arena.device, "batched decode step")
        finally:
            for pad in pads:
                pad.truncate(0)

    def _grow(self, need: int) -> None:
        self.capacity = max(need, 2 * self.capacity)
        for bucket in self._buckets.values():  # their graphs point at the old steps' device state
            bucket.free()
        self._buckets.clear()
        logger.debug("batched decode step capacity grown to %d tokens", self.capacity)
