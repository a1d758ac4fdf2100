"""CONDUIT's scoring and selection at kernel level, and top-k against torch.topk.

``scoring``: a ``scoring_layers``-layer arena holding text, ``n_visual`` visual tokens (images of
``tokens_per_image``) and the trailing text whose last ``n_text_queries`` tokens are the query
rows. One timed call is what ``reuse._PassScores.attention`` plus ``refresh.Conduit.select`` do
in a request: one native ``attention_mass`` over every layer, normalised by the rows' log-sum-exp
(which a request takes from its text pass's attention: here from ``Sequence.attention``, untimed),
the visual tokens' mass times the cached value norms, the layer mean, image amplification and the
global top-k, ending with the selection on the host (so it is timed on the wall clock). The raw
results also hold the mass's largest relative difference from ``attention_stats``, which finds the
normaliser itself. Its target is a share of a
full prefill of the same request, which the end-to-end run measures (``cli`` joins the two).

``topk``: ``selection.top_k_indices`` (what selection calls: the native ``conduit_topk``, indices
ascending) against ``torch.topk`` on the same random float32 scores.
"""
from __future__ import annotations

import math

import torch

from conduit_rt import topk as topk_native
from conduit_rt.refresh import Conduit, RefreshOptions, VisualTokens
from conduit_rt.selection import budget_tokens, top_k_indices

from .config import KernelSizes
from .kernels import KernelBench
from .stages import run_stages
from .targets import Target, at_least, at_most
from .timing import Timer


class _LayerScores:
    """The score source of one selection: a_l(t) from one ``attention_mass`` over every layer (as
    ``reuse._PassScores.attention``) and the value norms the image store keeps per entry."""

    def __init__(self, seq, queries: torch.Tensor, lse: torch.Tensor, q_pos: torch.Tensor, slots: torch.Tensor,
                 value_norms: torch.Tensor, scale: float, n_heads: int) -> None:
        self.seq, self.queries, self.lse, self.q_pos, self.slots = seq, queries, lse, q_pos, slots
        self.norms, self.scale, self.n_heads = value_norms, scale, n_heads

    def attention(self) -> torch.Tensor:
        layers = range(self.queries.shape[0])
        mass = self.seq.attention_mass(layers, self.queries, self.q_pos, self.lse, self.scale)
        return mass[:, self.slots] / (self.queries.shape[1] * self.n_heads)

    def value_norms(self) -> torch.Tensor:
        return self.norms


def scoring(bench: KernelBench) -> dict:
    s = bench.s
    n = s.n_text_before + s.n_visual + s.n_text_queries
    arena = bench.arena(n, n_layers=s.scoring_layers)
    try:
        seq, _, vs = bench.filled(arena, n, s.scoring_layers)
        visual = slice(s.n_text_before, s.n_text_before + s.n_visual)
        norms = torch.stack([v[visual].float().flatten(1).norm(dim=1) for v in vs])  # [L, N_vis]
        del vs
        queries = torch.stack([bench.randn(s.n_text_queries, s.n_heads, s.head_dim) for _ in range(s.scoring_layers)])
        q_pos = bench.positions(range(n - s.n_text_queries, n))
        lse = torch.stack([seq.attention(layer, queries[layer], q_pos, bench.scale, return_lse=True)[1]
                           for layer in range(s.scoring_layers)])  # the text pass's, in a request
        slots = torch.arange(visual.start, visual.stop, device=bench.device)
        image = torch.arange(s.n_visual) // s.tokens_per_image
        tokens = VisualTokens(slots.cpu(), image, int(image.max()) + 1)
        budget = budget_tokens(s.refresh, s.n_visual)
        policy, options = Conduit(), RefreshOptions()
        chosen: list = [None]

        def select() -> None:
            source = _LayerScores(seq, queries, lse, q_pos, slots, norms, bench.scale, s.n_heads)
            chosen[0] = policy.select(tokens, budget, source, options)

        timing = bench.timer.wall_time(select)
        mass = seq.attention_mass(range(s.scoring_layers), queries, q_pos, lse, bench.scale)
        stats_mass = torch.stack([seq.attention_stats(layer, queries[layer], q_pos, bench.scale)[0]
                                  for layer in range(s.scoring_layers)])
        rel_err = float(((mass - stats_mass).abs() / stats_mass.abs().clamp(min=1e-6)).max())
    finally:
        arena.close()
    return {"n_layers": s.scoring_layers, "n_queries": s.n_text_queries, "n_visual": s.n_visual,
            "n_keys": n, "budget": budget, "selected": int(chosen[0].numel()), "seconds": timing.median_s,
            "time": timing.as_dict(), "mass_rel_err_vs_attention_stats": rel_err}


def topk(bench: KernelBench) -> dict:
    s = bench.s
    scores = torch.rand(s.topk_n, device=bench.device, generator=bench.generator)
    ours = bench.timer.device_time(lambda: top_k_indices(scores, s.topk_k))
    reference = bench.timer.device_time(lambda: torch.topk(scores, s.topk_k))
    same = set(top_k_indices(scores, s.topk_k).tolist()) == set(torch.topk(scores, s.topk_k).indices.tolist())
    return {"n": s.topk_n, "k": s.topk_k, "seconds": ours.median_s, "time": ours.as_dict(),
            "torch_seconds": reference.median_s, "torch_time": reference.as_dict(), "same_indices": same,
            "implementation": "selection.top_k_indices: native conduit_topk (radix select, 5 launches, indices ascending)"
            if topk_native.native_backend_ready(scores.device.type) else "selection.top_k_indices: torch.topk + sort (fallback)"}


def run(timer: Timer, sizes: KernelSizes, dtype: torch.dtype) -> tuple[dict, list[Target], dict[str, str]]:
    bench = KernelBench(timer, sizes, dtype, seed=3)
    raw, errors = run_stages("scoring", [("scoring", lambda: scoring(bench)), ("topk", lambda: topk(bench))])
    rows = []
    if "topk" in raw:
        t = raw["topk"]
        rows.append(at_least("topk.vs_torch", f"top-{t['k']} of {t['n']} scores vs torch.topk", t["seconds"] * 1e3,
                             t["torch_seconds"] * 1e3, "ms", 4.0, "torch.topk time / our time", t["implementation"],
                             invert=True, valid=t["same_indices"]))
    return raw, rows, errors


def scoring_row(raw: dict, full_prefill_s: float, prefill_tokens: int) -> Target:
    """Scoring + selection at kernel level over a full prefill of ``prefill_tokens`` (end-to-end)."""
    r = raw["scoring"]
    what = f"CONDUIT scoring over {r['n_layers']} layers ({r['n_queries']} rows, {r['n_visual']} visual) + top-k"
    return at_most("scoring.vs_prefill", what,
                   r["seconds"] * 1e3, full_prefill_s * 1e3, "ms", 0.05,
                   "scoring + selection time / full prefill time",
                   f"prefill: {prefill_tokens} tokens through the end-to-end model, decoder only"
                   if math.isfinite(full_prefill_s) else "no end-to-end prefill measured")
