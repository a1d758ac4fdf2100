"""Small prefill passes with their dense work replayed from CUDA graphs, cut at the attentions.

A warm CONDUIT request forwards about a hundred text tokens through the decoder (the text pass), then
the ~10% of image tokens it refreshes (the recompute). For a 7B decoder on an H200 the text pass is
~11 ms of GPU work, but its ~13 launches a layer cost ~35 us of host time each, so launching it from
Python takes ~18 ms and the GPU waits. The decode step solves this by capturing everything
(``decode_graph``); a prefill pass cannot be captured whole as it is, since the native attention reads
its sequence's length and block table on the host and uploads the pass's slot list. So the pass is
cut at the attentions ("piecewise" graphs), and each dense stretch between two of them is one replay:

  piece 0        the embeddings -> layer 0's norm, q/k/v projections, q rotation (and the pass's RoPE tables)
  piece l        layer l-1's output projection, residual add, norm and MLP, then layer l's as in piece 0
  piece L        the last layer's output projection, norm and MLP -> the hidden states

Between pieces the layer's KV write and attention run eagerly (two native calls) on the first n rows
of the static buffers the pieces read and write. The pieces are captured once per token-count
bucket (``BUCKETS``: a pass of n tokens runs in the smallest bucket >= n); rows past n are padding
that the row-wise dense work carries along and that is never written to the arena nor attended.
Passes longer than the largest bucket run eagerly: their GPU work outlasts their launches.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from .models.base import ForwardBatch, LayerCapture
from .models.llama import LlamaDecoder

logger = logging.getLogger(__name__)

# Token counts captured. Steps of 64 past 64 keep the padding's extra GEMM work under ~10% for the
# recompute pass's sizes (a few hundred tokens).
BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024)


class _Pieces:
    """One bucket's static buffers and the functions its graphs record (see the module docstring).

    Buffers (``bucket`` rows): embeds and x [bucket, hidden] in the model dtype; rope int32 [bucket]
    or [3, bucket] (M-RoPE); cos, sin [bucket, n_freq]; q and attn [bucket, n_heads, head_dim]; k, v
    [bucket, n_kv_heads, head_dim]; hidden [bucket, hidden]."""

    def __init__(self, decoder, bucket: int, dtype: torch.dtype, device: torch.device) -> None:
        c = decoder.config
        self.decoder, self.bucket = decoder, bucket
        zeros = partial(torch.zeros, dtype=dtype, device=device)
        self.embeds, self.x, self.hidden = zeros(bucket, c.hidden), zeros(bucket, c.hidden), zeros(bucket, c.hidden)
        self.rope = torch.zeros((3, bucket) if c.rope.sections else (bucket,), dtype=torch.int32, device=device)
        n_freq = c.rope.rotary_dim // 2
        self.tables = (zeros(bucket, n_freq), zeros(bucket, n_freq))  # cos, sin (``RotaryEmbedding.tables``)
        self.q, self.attn = zeros(bucket, c.n_heads, c.head_dim), zeros(bucket, c.n_heads, c.head_dim)
        self.k, self.v = zeros(bucket, c.n_kv_heads, c.head_dim), zeros(bucket, c.n_kv_heads, c.head_dim)
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def functions(self) -> list:
        """The pieces in pass order: the first, one between each two layers, the last."""
        n_layers = len(self.decoder.layers)
        return [self.first, *(partial(self.between, layer) for layer in range(1, n_layers)), self.last]

    def run(self, seq, embeds: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None,
            piece: Callable[[int], None]) -> torch.Tensor:
        """One pass of n <= bucket tokens (``PrefillGraphs.forward``'s contract): the inputs into the
        static buffers, then piece(0), each layer's KV write and attention on the first n rows, and
        piece(layer + 1) after it. ``piece(i)`` runs ``functions()[i]``: a graph replay, or the call."""
        n = int(embeds.shape[0])
        self.embeds[:n].copy_(embeds)
        self.rope[..., :n].copy_(batch.rope_positions)
        piece(0)
        for layer, block in enumerate(self.decoder.layers):
            block.self_attn.attend(layer, seq, self.q[:n], self.k[:n], self.v[:n], batch, capture, out=self.attn[:n])
            piece(layer + 1)
        return self.hidden[:n].clone()  # the buffer is the next pass's

    def first(self) -> None:
        for table, value in zip(self.tables, self.decoder.rotary.tables(self.rope, self.embeds.dtype)):
            table.copy_(value)
        self._start(0, self.embeds, None)

    def between(self, layer: int) -> None:
        """Finishes layer - 1 (its attention is in ``attn``) and starts ``layer``."""
        x, delta = self.decoder.layers[layer - 1].post_attention(self.x, self.attn)
        self._start(layer, x, delta)

    def last(self) -> None:
        x, delta = self.decoder.layers[-1].post_attention(self.x, self.attn)
        torch.add(x, delta, out=self.hidden)

    def _start(self, layer: int, x: torch.Tensor, delta: torch.Tensor | None) -> None:
        x, q, k, v = self.decoder.layers[layer].pre_attention(x, delta, self.tables)
        for buffer, value in ((self.x, x), (self.q, q), (self.k, k), (self.v, v)):
            buffer.copy_(value)


class PrefillGraphs:
    """Prefill passes of ``model`` (its Llama decoder) with the dense work replayed per bucket.

    ``forward`` stands in for ``model.forward``. A bucket is captured the first time a pass uses it;
    if capture fails the bucket runs eagerly from then on. Memory: each captured bucket keeps its
    static buffers (for LLaVA-7B about 56 KiB a row: 56 MiB at 1024 rows), and the graphs' transient
    tensors share one pool across buckets (pieces never run concurrently), the size of the largest
    piece's (the MLP's [bucket, 2 intermediate] product). The graphs read the weights where they were
    at capture: replacing the model's parameters afterwards needs a new ``PrefillGraphs``.
    """

    def __init__(self, model, buckets: tuple[int, ...] = BUCKETS) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        if not self.supports(model):
            raise ValueError("prefill graphs need a model whose language_model is a llama.LlamaDecoder")
        self.model, self.decoder = model, model.language_model
        self.buckets = tuple(sorted(buckets))
        self._pieces: dict[int, _Pieces | None] = {}  # None: capture failed, eager
        self._pool = torch.cuda.graph_pool_handle()  # pieces run one after another: one pool serves all
        self.replayed_passes = 0  # passes served by replays (the rest ran eagerly)

    @staticmethod
    def supports(model) -> bool:
        """Whether the model's decoder is the Llama one whose layers split around the attention, with
        no DeepStack features to add between them."""
        return isinstance(getattr(model, "language_model", None), LlamaDecoder) and not model.config.deepstack_layers

    def forward(self, seq, embeds: torch.Tensor, batch: ForwardBatch,
                capture: LayerCapture | None = None) -> torch.Tensor:
        """As ``model.forward``: embeds [n, hidden] -> hidden states [n, hidden] (a new tensor), K and V of
        every layer written to ``batch.slots`` of ``seq``."""
        n = int(embeds.shape[0])
        pieces = self._pieces_for(n)
        if pieces is None:
            return self.model.forward(seq, embeds, batch, capture)
        hidden = pieces.run(seq, embeds, batch, capture, lambda index: pieces.graphs[index].replay())
        self.replayed_passes += 1
        return hidden

    def close(self) -> None:
        """Drops every graph and buffer."""
        self._pieces.clear()

    def _pieces_for(self, n: int) -> _Pieces | None:
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or n == 0:
            return None
        if bucket not in self._pieces:
            self._pieces[bucket] = self._capture(bucket)
        return self._pieces[bucket]

    def _capture(self, bucket: int) -> _Pieces | None:
        """Runs each piece once on a side stream (Triton compiles, cuBLAS picks its kernels and the
        allocator grows outside the capture), then records each into its graph."""
        current = torch.cuda.current_stream(self.model.device)
        side = torch.cuda.Stream(self.model.device)
        try:
            # Plain tensors even if the caller runs under inference mode: later passes outside it
            # write into them.
            with torch.inference_mode(False):
                pieces = _Pieces(self.decoder, bucket, self.model.dtype, self.model.device)
            functions = pieces.functions()
            side.wait_stream(current)
            try:
                with torch.no_grad(), torch.cuda.stream(side):
                    for function in functions:
                        function()
            finally:  # also when a piece fails: the buffers go back to the allocator only after the side stream
                current.wait_stream(side)
            with torch.no_grad():
                for function in functions:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        function()
                    pieces.graphs.append(graph)
            logger.debug("prefill pieces captured for %d tokens", bucket)
            return pieces
        except Exception as e:  # noqa: BLE001 (an op that cannot be captured, or out of memory: run eagerly)
            logger.warning("prefill passes of up to %d tokens not captured in CUDA graphs, running eagerly: %s",
                           bucket, e)
            return None
