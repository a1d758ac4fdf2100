"""Prefill passes whose dense work is replayed piecewise from CUDA graphs (``prefill_graph``) against
the same passes run eagerly: hidden states, the KV written to the arena and the q rows a capture sees."""
from __future__ import annotations

import pytest
import torch

from conduit_rt.bench import synthetic
from conduit_rt.models.base import ForwardBatch
from conduit_rt.models.random_init import random_llava
from conduit_rt.prefill_graph import PrefillGraphs, _Pieces


class QRecorder:
    """LayerCapture keeping a copy of every layer's q and pre-RoPE k."""

    def __init__(self) -> None:
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.lse: dict[int, torch.Tensor] = {}

    def on_layer(self, layer: int, q: torch.Tensor, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        self.q[layer], self.k[layer] = q.clone(), k_pre_rope.clone()

    def on_attention(self, layer: int, lse: torch.Tensor) -> None:
        self.lse[layer] = lse


def assert_same_kv(got_seq, want_seq, slots: list[int], n_layers: int, tol: dict) -> None:
    """K and V of the written ``slots`` of every layer agree (the others hold whatever the pool held)."""
    for layer in range(n_layers):
        for got_kv, want_kv in zip(got_seq.read_kv(layer), want_seq.read_kv(layer)):
            torch.testing.assert_close(got_kv[slots], want_kv[slots], **tol)


def _batch(positions: list[int], device: str) -> ForwardBatch:
    index = torch.tensor(positions, dtype=torch.int32, device=device)
    return ForwardBatch(positions=index, rope_positions=index.clone(), slots=positions)


def test_pieces_called_in_pass_order_equal_the_model_forward():
    """What the graphs record, run as plain calls on the CPU: the cut at the attentions, the padded
    static buffers and the RoPE tables give model.forward's hidden states and KV (float32)."""
    text, vision = synthetic.llava_configs("tiny")
    model = random_llava(text, vision, "cpu", torch.float32, seed=3)
    arena = model.new_arena(8 << 20)
    embeds = torch.randn(40, text.hidden_size, generator=torch.Generator().manual_seed(0))
    eager_seq, pieces_seq = arena.new_sequence(), arena.new_sequence()
    for seq in (eager_seq, pieces_seq):
        seq.append(range(40))
        model.forward(seq, embeds[:20], _batch(list(range(20)), "cpu"))  # into slots 0..19
    pieces = _Pieces(model.language_model, 16, torch.float32, torch.device("cpu"))
    functions = pieces.functions()
    written = set(range(20))
    # 12 rows, then 4 scattered ones (each sees only written slots), both in a 16-row bucket
    for positions in (list(range(20, 32)), [21, 25, 30, 32]):
        rows = torch.tensor(positions)
        want = model.forward(eager_seq, embeds[rows], _batch(positions, "cpu"))
        got = pieces.run(pieces_seq, embeds[rows], _batch(positions, "cpu"), None, lambda i: functions[i]())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        written |= set(positions)
        assert_same_kv(pieces_seq, eager_seq, sorted(written), text.num_hidden_layers, dict(rtol=1e-5, atol=1e-5))


def test_prefill_graphs_need_cuda():
    text, vision = synthetic.llava_configs("tiny")
    model = random_llava(text, vision, "cpu", torch.float32, seed=3)
    with pytest.raises(ValueError, match="CUDA"):
        PrefillGraphs(model)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_passes_equal_eager_passes(dtype):
    torch.manual_seed(0)
    text, vision = synthetic.llava_configs("tiny")
    model = random_llava(text, vision, "cuda", dtype, seed=3)
    arena = model.new_arena(64 << 20)
    graphs = PrefillGraphs(model, buckets=(16, 64))
    n = 120
    embeds = torch.randn(n, text.hidden_size, device="cuda", dtype=dtype)
    eager_seq, graph_seq = arena.new_sequence(), arena.new_sequence()
    for seq in (eager_seq, graph_seq):  # the same 60-token prefix, computed eagerly
        seq.append(range(n))
        model.forward(seq, embeds[:60], _batch(list(range(60)), "cuda"))  # into slots 0..59
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    # Two passes in bucket 64 (the second replays the first's graphs with other rows), one scattered
    # like a CONDUIT recompute (bucket 16), then one past the largest bucket (eager, not replayed).
    passes = [list(range(60, 97)), list(range(97, 120)), [61, 64, 70, 83, 99, 104, 111, 115, 119],
              list(range(40, 120))]
    written = set(range(60))
    for number, positions in enumerate(passes):
        rows = torch.tensor(positions, device="cuda")
        eager_capture, graph_capture = QRecorder(), QRecorder()
        want = model.forward(eager_seq, embeds[rows], _batch(positions, "cuda"), eager_capture)
        got = graphs.forward(graph_seq, embeds[rows], _batch(positions, "cuda"), graph_capture)
        torch.testing.assert_close(got, want, **tol)
        for layer in range(text.num_hidden_layers):
            torch.testing.assert_close(graph_capture.q[layer], eager_capture.q[layer], **tol)
            torch.testing.assert_close(graph_capture.k[layer], eager_capture.k[layer], **tol)
            torch.testing.assert_close(graph_capture.lse[layer], eager_capture.lse[layer], **tol)
        written |= set(positions)
        assert_same_kv(graph_seq, eager_seq, sorted(written), text.num_hidden_layers, tol)
        assert graphs.replayed_passes == min(number + 1, 3)
    assert set(graphs._pieces) == {16, 64}
    assert len(graphs._pieces[64].graphs) == text.num_hidden_layers + 1
