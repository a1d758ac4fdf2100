"""CacheBlend, the layer-wise refresh baseline (docs/methods.md §1): every visual token is recomputed
on the first layers, then after each layer only the tokens whose fresh K and V moved most from the
cached ones (||dK|| + ||dV||, before RoPE) go on, in counts falling linearly with mean = budget."""
from __future__ import annotations

import functools

import torch

from ..selection import apportion, top_k_indices
from .base import RefreshContext, Refreshed, RefreshPolicy


class CacheBlend(RefreshPolicy):
    """Selects inside its own recompute, layer by layer; ``layer_counts`` says how many visual
    tokens each layer recomputes."""

    name = "cacheblend"

    # Every token is recomputed on the first two layers: a token's layer-0 K and V depend on its own
    # embedding only, so the first informative deviation (||dK|| + ||dV||) is the one after layer 1.
    FULL_LAYERS = 2

    @staticmethod
    def layer_counts(n_visual: int, budget: int, n_layers: int) -> list[int]:
        """Visual tokens recomputed per layer: all of them on the first FULL_LAYERS layers, then a
        count falling linearly (clipped at 0) so that the total is budget * n_layers where the first
        layers leave room for it (so the mean per layer is the budget)."""
        if budget == 0:
            return [0] * n_layers
        full = min(CacheBlend.FULL_LAYERS, n_layers)
        rest_layers = n_layers - full
        rest = max(0, budget * n_layers - full * n_visual)
        if rest_layers == 0 or rest == 0:
            return [n_visual] * full + [0] * rest_layers
        if rest >= n_visual * rest_layers:
            return [n_visual] * n_layers

        def mass(t: float) -> float:  # sum over the remaining layers of max(0, 1 - (i + 1) / t)
            return sum(max(0.0, 1.0 - (i + 1) / t) for i in range(rest_layers))

        lo, hi = 1e-9, 4.0 * n_layers
        for _ in range(100):  # bisection on the decay length so that n_visual * mass(t) = rest
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if n_visual * mass(mid) < rest else (lo, mid)
        weights = [max(0.0, 1.0 - (i + 1) / hi) for i in range(rest_layers)]
        # sorted: a deeper layer never recomputes more tokens than the one before (its tokens are a subset)
        return [n_visual] * full + sorted(apportion(weights, rest, [n_visual] * rest_layers), reverse=True)

    def refresh(self, context: RefreshContext) -> Refreshed:
        """Every visual token (and the text after the first) through layer 0; after each layer the
        rows going on are every text row and the visual rows that changed most."""
        tokens, budget, n_layers = context.tokens, context.budget, context.config.n_layers
        if budget == 0:
            return Refreshed(context.text_pass_logits(), 0)
        counts = self.layer_counts(tokens.n, budget, n_layers)
        rows = context.recompute_rows(tokens.slots.numpy()).tolist()
        visual_of_slot = {int(s): i for i, s in enumerate(tokens.slots.tolist())}
        # row -> index among the visual tokens (-1 for text rows)
        visual_index = torch.tensor([visual_of_slot.get(r, -1) for r in rows], dtype=torch.long)
        x = context.embed(rows)
        for layer in range(n_layers):
            delta = _LayerDelta(visual_index, functools.partial(context.cached_kv, layer))
            x = context.forward_layer(layer, rows, x, delta)
            if layer + 1 < n_layers:
                keep = delta.keep(counts[layer + 1])
                x, visual_index = x[keep.to(x.device)], visual_index[keep]
                rows = [rows[i] for i in keep.tolist()]
        return Refreshed(context.last_logits(x), budget)

    def select(self, tokens, budget, scores, options):
        raise RuntimeError("cacheblend selects inside its layer-wise recompute (CacheBlend.refresh)")


class _LayerDelta:
    """One layer of CacheBlend: ||K_fresh - K_cached|| + ||V_fresh - V_cached|| (pre-RoPE) per visual row."""

    def __init__(self, visual_index: torch.Tensor, cached_kv) -> None:
        self.visual_index, self.cached_kv = visual_index, cached_kv
        self.change: torch.Tensor | None = None

    def on_layer(self, layer: int, q, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        is_visual = self.visual_index >= 0
        k_old, v_old = self.cached_kv()
        rows = torch.nonzero(is_visual).flatten().to(k_pre_rope.device)
        idx = self.visual_index[is_visual].to(k_old.device)
        dk = (k_pre_rope[rows].float() - k_old[idx].float()).flatten(1).norm(dim=1)
        dv = (v[rows].float() - v_old[idx].float()).flatten(1).norm(dim=1)
        self.change = torch.full((self.visual_index.numel(),), float("-inf"), device=dk.device)
        self.change[rows] = dk + dv

    def keep(self, n_visual: int) -> torch.Tensor:
        """Row indices (CPU, sorted) for the next layer: every text row and the n_visual most changed."""
        is_visual = self.visual_index >= 0
        visual_rows = torch.nonzero(is_visual).flatten()
        change = self.change.cpu()[visual_rows]
        top = visual_rows[top_k_indices(change, min(n_visual, visual_rows.numel()))]
        return torch.sort(torch.cat([torch.nonzero(~is_visual).flatten(), top])).values
