"""Refresh policies beyond the papers (docs/methods.md, "Policies beyond the papers"): CONDUIT's score
with more query rows, re-scored after a partial refresh, or weighted by a one-layer KV deviation.

CONDUIT scores the restored visual tokens with the question's attention over stale keys, which can
point at the wrong tokens; each policy here attacks that under the same budget B = ceil(r * N_vis):

  conduit_allq       CONDUIT with Q every text token from the first image on
  conduit_rescore    CONDUIT picks ceil(B/2) tokens, they are recomputed, the question's attention over
                     the partly refreshed KV picks the other B - ceil(B/2), then one pass over all B
  conduit_deviation  CONDUIT's score times ||dK|| + ||dV|| at layer 1 after recomputing every visual
                     token through layer 0
  conduit_focus      attention per head, weighted by how much of its mass the head puts on B tokens,
                     times the value norm; the budget shared among the images by size
  conduit_local      conduit_focus over the shallower half of the layers, with every head's attention
                     normalised within each image: which of an image's tokens the question reads,
                     whether or not the stale keys rank that image first
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from ..selection import apportion, top_k_indices
from .base import RefreshContext, Refreshed, RefreshPolicy, ScoreSource
from .policies import Conduit, conduit_scores


class ProbingContext(RefreshContext, Protocol):
    """The calls these policies need beyond ``RefreshContext`` (``reuse._Context`` has them)."""

    def rescore(self) -> ScoreSource:
        """Scores whose query rows' q and attention come from the latest pass that computed them
        (after a recompute: its rows, over the KV it left); computed and charged now."""

    def first_layer_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every restored visual token through layer 0 in this request (writing their layer-0 KV,
        which depends on the token's embedding alone and so equals the restored one), then layer 1's
        K before RoPE and V of that output, not written: [N, n_kv_heads, head_dim] each."""

    def head_attention(self) -> torch.Tensor:
        """a_{l,h}(t) per chosen layer and query head, the mean over the query rows: float32 [L, H, N]."""


class ConduitAllQ(Conduit):
    """CONDUIT (steps 5-7) with the query rows every text token from the first image on."""

    name = "conduit_allq"

    def query_positions(self, prompt, options):
        return prompt.text_after_first_image()


class ConduitRescore(RefreshPolicy):
    """Two CONDUIT selections: the second scored over the KV the first one refreshed."""

    name = "conduit_rescore"
    uses_scores = True
    FIRST_SHARE = 0.5  # of the budget, chosen by the stale scores

    def refresh(self, context: ProbingContext) -> Refreshed:
        context.start_scoring()
        first = self.first_share(context)
        if first.numel() == context.budget:  # a budget of 0 or 1: nothing left to re-score
            return Refreshed(context.recompute(first), context.budget)
        context.recompute(first)
        chosen = torch.sort(torch.cat([first, self.second_share(context, first)])).values
        return Refreshed(context.recompute(chosen), context.budget)

    def first_share(self, context: RefreshContext) -> torch.Tensor:
        """The top ceil(FIRST_SHARE * B) by CONDUIT's score (sorted int64 indices, CPU)."""
        k = math.ceil(self.FIRST_SHARE * context.budget)
        return top_k_indices(conduit_scores(context.tokens, context.scores, context.options), k).cpu()

    def second_share(self, context: ProbingContext, first: torch.Tensor) -> torch.Tensor:
        """The top B - |first| of the tokens not in ``first``, by CONDUIT's score over the partly
        refreshed KV (value norms and amplification as in steps 5-6, over every token)."""
        scores = conduit_scores(context.tokens, context.rescore(), context.options)
        scores[first.to(scores.device)] = float("-inf")
        return top_k_indices(scores, context.budget - first.numel()).cpu()

    def select(self, tokens, budget, scores, options):
        raise RuntimeError("conduit_rescore selects between its two recomputes (ConduitRescore.refresh)")


class ConduitDeviation(RefreshPolicy):
    """CONDUIT's score times each token's layer-1 KV deviation, one global top-k."""

    name = "conduit_deviation"
    uses_scores = True

    def refresh(self, context: ProbingContext) -> Refreshed:
        context.start_scoring()
        if context.budget == 0:
            return Refreshed(context.recompute(torch.zeros(0, dtype=torch.long)), 0)
        score = conduit_scores(context.tokens, context.scores, context.options)
        score = score * self.deviation(context).to(score.device)
        return Refreshed(context.recompute(top_k_indices(score, context.budget).cpu()), context.budget)

    @staticmethod
    def deviation(context: ProbingContext) -> torch.Tensor:
        """||K_1 fresh - K_1 cached||_2 + ||V_1 fresh - V_1 cached||_2 per visual token (pre-RoPE, over
        all KV heads): float32 [N]. A one-layer model has no layer 1: ones (CONDUIT's order)."""
        if context.config.n_layers < 2:
            return torch.ones(context.tokens.n)
        k_fresh, v_fresh = context.first_layer_kv()
        k_old, v_old = context.cached_kv(1)
        dk = (k_fresh.float() - k_old.to(k_fresh.device).float()).flatten(1).norm(dim=1)
        dv = (v_fresh.float() - v_old.to(v_fresh.device).float()).flatten(1).norm(dim=1)
        return dk + dv

    def select(self, tokens, budget, scores, options):
        raise RuntimeError("conduit_deviation selects after its layer-0 probe (ConduitDeviation.refresh)")


class ConduitFocus(RefreshPolicy):
    """CONDUIT's attention x value norm, with the heads weighted by focus and the budget shared among
    the images by size (docs/methods.md, "Policies beyond the papers")."""

    name = "conduit_focus"
    uses_scores = True
    FOCUS_POWER = 4  # sharpens the weights: one focused head outweighs many diffuse ones

    def refresh(self, context: ProbingContext) -> Refreshed:
        if context.budget == 0:
            return Refreshed(context.recompute(torch.zeros(0, dtype=torch.long)), 0)
        score = self.scores(context.head_attention(), context.scores.value_norms(), context.budget)
        return Refreshed(context.recompute(per_image_top_k(score, context.tokens.image, context.budget)),
                         context.budget)

    @classmethod
    def scores(cls, attention: torch.Tensor, value_norms: torch.Tensor, budget: int) -> torch.Tensor:
        """attention [L, H, N], value_norms [L, N] (float32, one device) -> float32 [N]: each head's
        share of its visual attention per token, weighted by focus^FOCUS_POWER (the share on its top
        ``budget`` tokens), summed over layers and heads, times the layer mean of ||V||."""
        share = attention / attention.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        focus = share.topk(min(budget, share.shape[-1]), dim=-1).values.sum(dim=-1)    # [L, H] in [0, 1]
        return (share * focus[..., None] ** cls.FOCUS_POWER).sum(dim=(0, 1)) * value_norms.mean(dim=0)

    def select(self, tokens, budget, scores, options):
        raise RuntimeError("conduit_focus scores per head (ConduitFocus.refresh)")


class ConduitLocal(RefreshPolicy):
    """conduit_focus on the shallower half of the layers, with attention normalised within each image
    (docs/methods.md, "Policies beyond the papers").

    Stale keys mislead the question most about *which image* it asks about (an image computed under
    another prefix still carries that prefix's membership), much less about which of an image's tokens
    hold what it asks for (read by the vision tower, right in every layer's K). Normalising each
    head's attention within each image keeps the second kind of evidence only, and the shallower half
    of the layers, where a cached key has mixed in least of its old context, gives it most reliably.
    The budget is shared among the images by size, so every image refreshes the tokens the question
    would read there, and the candidates of every image get their membership computed afresh.
    """

    name = "conduit_local"
    uses_scores = True
    FOCUS_POWER = ConduitFocus.FOCUS_POWER

    def refresh(self, context: ProbingContext) -> Refreshed:
        if context.budget == 0:
            return Refreshed(context.recompute(torch.zeros(0, dtype=torch.long)), 0)
        image = context.tokens.image.cpu()
        attention = context.head_attention()                                # [L, H, N]
        shallow = shallower_half(attention.shape[0])
        score = self.scores(attention[shallow], context.scores.value_norms()[shallow], image,
                            image_shares(image, context.budget))
        return Refreshed(context.recompute(per_image_top_k(score, image, context.budget)), context.budget)

    @classmethod
    def scores(cls, attention: torch.Tensor, value_norms: torch.Tensor, image: torch.Tensor,
               shares: list[int]) -> torch.Tensor:
        """attention [L, H, N], value_norms [L, N] (float32, one device), image int64 [N] (CPU), each
        image's share of the budget -> float32 [N]: each head's attention share within the token's
        image, weighted by that head's focus on the image (its share on the image's top ``shares[j]``
        tokens) ^ FOCUS_POWER, summed over layers and heads, times the layer mean of ||V||."""
        n_images = len(shares)
        on_device = image.to(attention.device)
        mass = torch.zeros(*attention.shape[:2], n_images, device=attention.device).index_add_(2, on_device, attention)
        within = attention / mass[..., on_device].clamp(min=torch.finfo(torch.float32).tiny)
        focus = torch.zeros_like(mass)                                                  # [L, H, n_images]
        for j, k in enumerate(shares):
            if k:
                members = torch.nonzero(image == j).flatten().to(attention.device)
                focus[..., j] = within[..., members].topk(min(k, members.numel()), dim=-1).values.sum(dim=-1)
        weight = focus[..., on_device] ** cls.FOCUS_POWER
        return (within * weight).sum(dim=(0, 1)) * value_norms.mean(dim=0)

    def select(self, tokens, budget, scores, options):
        raise RuntimeError("conduit_local scores per head and image (ConduitLocal.refresh)")


def shallower_half(n_layers: int) -> slice:
    """The first ceil(n / 2) of ``n_layers`` scored layers (in the order ``options.layers`` gives)."""
    return slice(0, (n_layers + 1) // 2)


def image_shares(image: torch.Tensor, budget: int) -> list[int]:
    """``budget`` shared among the images in proportion to their token counts by largest remainder
    (``image``: int64 [N], CPU): one count per image."""
    n_images = int(image.max()) + 1 if image.numel() else 0
    sizes = torch.bincount(image, minlength=n_images).tolist()
    return apportion([float(size) for size in sizes], budget, sizes)


def per_image_top_k(score: torch.Tensor, image: torch.Tensor, budget: int) -> torch.Tensor:
    """The top tokens of each image by ``score`` (float [N]), ``budget`` shared among the images in
    proportion to their token counts by largest remainder (``image``: int64 [N], CPU): sorted int64
    indices, CPU."""
    image = image.cpu()
    shares = image_shares(image, budget)
    score = score.cpu()
    chosen = []
    for j, k in enumerate(shares):
        if k:
            members = torch.nonzero(image == j).flatten()
            chosen.append(members[top_k_indices(score[members], k)])
    return torch.sort(torch.cat(chosen)).values if chosen else torch.zeros(0, dtype=torch.long)
