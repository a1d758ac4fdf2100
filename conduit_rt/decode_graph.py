"""The decode step as one CUDA graph replay per token.

A single-token step of a 7B decoder moves ~13 GB of weights in ~3.5 ms on an H200, but launching it
from Python (32 layers x norms, projections, RoPE, the native write and attention, the MLP: ~20
launches a layer) takes longer than that. ``GraphedDecoder`` records the step once into a
``torch.cuda.CUDAGraph`` and replays it for every later token:

- the model runs over a native ``DecodeStep`` instead of a ``Sequence``: its kernels read each
  sequence's length and block table from device memory at fixed addresses, so the recorded launches
  stay valid as the sequence grows and whichever sequence the step is prepared with;
- the token id, its causal position and its RoPE position are static device buffers, filled before
  each replay; the logits are a static output, valid until the next step.

Per token: ``DecodeStep.prepare`` (host: append the token's slot, patch the step's device tables),
fill the inputs, replay. The token may be a device tensor (the sampler's output): nothing here waits
for the GPU, so the Runtime enqueues step i + 1 while step i runs. Before the first capture, one
eager step over a scratch one-token sequence warms cuBLAS and the caching allocator (capture must
not be their first use), so every real step is a replay. A sequence longer than the step's capacity
gets a larger step and a new capture.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .arena import DecodeStep, KVArena, Sequence
from .errors import ArenaFullError
from .models.base import ForwardBatch

logger = logging.getLogger(__name__)


class GraphedDecoder:
    """Single-sequence decode steps of ``model`` over ``arena``, replayed from a captured CUDA graph.

    capacity: tokens per layer the first step object holds (it doubles when a sequence outgrows it).
    """

    def __init__(self, model, arena: KVArena, capacity: int = 4096) -> None:
        if arena.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA arena")
        self.model, self.arena = model, arena
        self.capacity = capacity
        device = arena.device
        self._token = torch.zeros(1, dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.int32, device=device)
        rope_shape = (3, 1) if model.config.rope.sections else (1,)  # M-RoPE: t, h, w rows
        self._rope = torch.zeros(rope_shape, dtype=torch.int32, device=device)
        self._step: DecodeStep = arena.new_step(1, capacity, model.config.n_heads)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self._capture_failed = False
        self.steps = 0    # calls of step
        self.replays = 0  # steps served by a replay (the rest ran eagerly)

    def step(self, seq: Sequence, token: torch.Tensor | int, position: int, rope_position: int) -> torch.Tensor:
        """Appends ``token`` (an id, or an int64 scalar tensor on the device) at causal ``position`` (RoPE
        position ``rope_position``) to ``seq`` and returns the next-token logits: float32 [vocab], valid
        until the next call."""
        self.steps += 1
        longest = seq.max_tokens()
        if longest + 1 > self.capacity:
            self._grow(longest + 1)
        if self._graph is None and not self._capture_failed:
            self._capture()
        self._step.prepare([seq], [position])
        self._fill_inputs(token, position, rope_position)
        if self._graph is None:  # capture failed: eager
            return self._forward()
        self._graph.replay()
        self.replays += 1
        return self._logits

    def close(self) -> None:
        """Drops the graph and frees the step's device state."""
        self._graph, self._logits = None, None
        self._step.free()

    def _forward(self) -> torch.Tensor:
        """The step's work on the static buffers: token -> logits [vocab] float32."""
        embeds = self.model.embed_tokens(self._token)
        batch = ForwardBatch(positions=self._position, rope_positions=self._rope)
        return self.model.logits(self.model.forward(self._step, embeds, batch))[0]

    def _fill_inputs(self, token: torch.Tensor | int, position: int, rope_position: int) -> None:
        self._token.fill_(token)  # from a device scalar: a device-side copy, no host sync
        self._position.fill_(position)
        self._rope.fill_(rope_position)

    def _capture(self) -> None:
        """Warms up on a scratch sequence (one token at position 0), then records the step. The
        recording runs nothing; the step object is re-prepared with the real sequence before replay."""
        scratch = self.arena.new_sequence()

        def prepare() -> None:
            self._step.prepare([scratch], [0])
            self._fill_inputs(0, 0, 0)

        try:
            self._graph, self._logits, self._capture_failed = capture_graph(prepare, self._forward, self.arena.device,
                                                                            "decode step")
        finally:
            scratch.free()

    def _grow(self, need: int) -> None:
        self.capacity = max(need, 2 * self.capacity)
        self._graph, self._logits = None, None  # it points at the old step's device state
        self._step.free()
        self._step = self.arena.new_step(1, self.capacity, self.model.config.n_heads)
        logger.debug("decode step capacity grown to %d tokens", self.capacity)


def capture_graph(prepare: Callable[[], None], forward: Callable[[], torch.Tensor], device: torch.device,
                  what: str) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None, bool]:
    """Runs ``prepare`` and ``forward`` once eagerly (capture must not be the first use of cuBLAS or
    the caching allocator), then records ``forward`` into a CUDA graph. Returns (graph, its static
    output, False); (None, None, False) when the arena had no room for the scratch tokens
    ``prepare`` appends (capture again later); (None, None, True) when the work cannot be captured
    (run it eagerly from now on). Ends by waiting for ``device``'s stream: the warm-up used scratch
    blocks that the caller frees. ``what`` names the work in the log."""
    try:
        prepare()
        forward()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = forward()
        return graph, output, False
    except ArenaFullError:  # no room for the scratch tokens now: this step runs eagerly, capture later
        logger.debug("%s graph capture postponed: the arena is full", what)
        return None, None, False
    except Exception as e:  # noqa: BLE001 (an op that cannot be captured, or out of memory: decode eagerly)
        logger.warning("%s not captured in a CUDA graph, running eagerly from now on: %s", what, e)
        return None, None, True
    finally:
        torch.cuda.current_stream(device).synchronize()
