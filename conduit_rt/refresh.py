"""Refresh policies: which cached (stale) visual tokens a request recomputes, all under one budget.

Every policy sees the same inputs (the restored visual tokens, the budget ``ceil(r * N_vis)``, a
lazy source of scores, the options) and returns the sorted indices of the tokens to recompute.
METHODS.md §1 defines each one; ``conduit`` is the method, the others are baselines:

  full        every visual token (the quality reference)
  none        nothing: reuse the restored KV as is
  first       the first tokens of each image, apportioned by image size (MPIC/EPIC-style)
  random      uniformly random tokens (seeded)
  attention   attention mass of the query rows, no value norm, no amplification (ProphetKV-style)
  cacheblend  layer-wise: every token on layers 0-1, then the top tokens by ||dK|| + ||dV|| per layer,
              counts decaying linearly with mean = budget (recomputed inside the pass: ``layerwise``)
  conduit     attention mass x value norm, layer mean, image-level amplification, one global top-k
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from . import topk
from .errors import RequestError

FILL_MODES = ("isolated", "in_context")


@dataclass(frozen=True, slots=True)
class RefreshOptions:
    """Per-request knobs of refresh (defaults from METHODS.md §1).

    lam: image-level amplification strength λ (conduit).
    query_tokens: the query rows of the score; None = the trailing text segment (after the last
        image), N = the last N prompt tokens.
    layers: decoder layers averaged in the score; None = all.
    fill: how a missing image's KV is made: "isolated" (the image prefilled alone in a one-image
        chat wrapper, the reference code's default) or "in_context" (as computed in the request).
    seed: the random policy's seed.
    """

    lam: float = 1.0
    query_tokens: int | None = None
    layers: tuple[int, ...] | None = None
    fill: str = "isolated"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fill not in FILL_MODES:
            raise RequestError(f"fill must be one of {FILL_MODES}, got {self.fill!r}")
        if self.query_tokens is not None and self.query_tokens < 1:
            raise RequestError(f"query_tokens must be >= 1, got {self.query_tokens}")
        if not math.isfinite(self.lam) or self.lam < 0:
            raise RequestError(f"lam must be a finite number >= 0, got {self.lam}")
        if self.layers is not None and not self.layers:
            raise RequestError("layers must name at least one layer (None = all)")


@dataclass(frozen=True, slots=True)
class VisualTokens:
    """The restored visual tokens of a request, in prompt order.

    slots: int64 [N] their slots (= causal positions) in the sequence; image: int64 [N] which restored
    image each belongs to (0..n_images-1, prompt order); n_images.
    """

    slots: torch.Tensor
    image: torch.Tensor
    n_images: int

    @property
    def n(self) -> int:
        return int(self.slots.numel())


class ScoreSource(Protocol):
    """Scores computed on demand, over the chosen layers (see reuse.py)."""

    def attention(self) -> torch.Tensor:
        """a_l(t): float32 [n_layers_chosen, N], attention mass per query row and head."""

    def value_norms(self) -> torch.Tensor:
        """||V_l(t)||_2 over all KV heads: float32 [n_layers_chosen, N]."""


def budget_tokens(ratio: float, n_visual: int) -> int:
    """B = ceil(r * N_vis), robust to float error (0.1 * 30 is 3, not 4)."""
    if not 0.0 <= ratio <= 1.0:
        raise RequestError(f"refresh_budget must be in [0, 1], got {ratio}")
    return min(n_visual, math.ceil(round(ratio * n_visual, 9)))


def apportion(weights: list[float], total: int, caps: list[int] | None = None) -> list[int]:
    """Integer shares of ``total`` proportional to ``weights`` (largest remainder), each <= its cap."""
    caps = caps or [total] * len(weights)
    weight_sum = sum(weights)
    if total == 0 or weight_sum <= 0:
        return [0] * len(weights)
    quotas = [total * w / weight_sum for w in weights]
    shares = [min(int(q), c) for q, c in zip(quotas, caps)]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - int(quotas[i])), i))
    while sum(shares) < total:
        progressed = False
        for i in order:
            if sum(shares) == total:
                break
            if shares[i] < caps[i]:
                shares[i] += 1
                progressed = True
        if not progressed:
            break
    return shares


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, sorted ascending (int64 [k], on scores' device): the native
    top-k (topk.py; ties to the lower index, NaN above +inf). k <= 0 selects nothing; k > n raises
    InvalidArgumentError."""
    return topk.top_k_indices(scores, max(0, k))


def amplify(scores: torch.Tensor, image: torch.Tensor, n_images: int, lam: float) -> torch.Tensor:
    """Image-level relevance amplification: s'(t) = c_j(t) * s(t), c_j = 1 + λ (m_j / mean m - 1),
    m_j = mean over image j's tokens of max(s, 0). One image: c = 1.

    scores: float [N] on any device; image: int64 [N] on the CPU (which image each token is of). No
    host sync: the image sizes are counted on the host, and a zero mean m (c = 1) is chosen on the
    device, so the launches of the selection that follows queue behind the scoring.
    """
    if n_images <= 1 or lam == 0:
        return scores
    counts = torch.bincount(image, minlength=n_images).to(scores.device, scores.dtype, non_blocking=True)
    image = image.to(scores.device, non_blocking=True)
    sums = torch.zeros(n_images, dtype=scores.dtype, device=scores.device).index_add_(0, image, scores.clamp(min=0))
    m = sums / counts
    mean_m = m.mean()
    c = torch.where(mean_m > 0, 1 + lam * (m / mean_m - 1), torch.ones_like(m))
    return c[image] * scores


class RefreshPolicy:
    """Base: a named rule choosing ``budget`` of the N restored visual tokens."""

    name = ""
    uses_scores = False
    layerwise = False

    def select(self, tokens: VisualTokens, budget: int, scores: ScoreSource, options: RefreshOptions) -> torch.Tensor:
        raise NotImplementedError


class Full(RefreshPolicy):
    name = "full"

    def select(self, tokens, budget, scores, options):
        return torch.arange(tokens.n)


class NoRefresh(RefreshPolicy):
    name = "none"

    def select(self, tokens, budget, scores, options):
        return torch.zeros(0, dtype=torch.long)


class First(RefreshPolicy):
    name = "first"

    def select(self, tokens, budget, scores, options):
        sizes = torch.bincount(tokens.image.cpu(), minlength=tokens.n_images).tolist()
        shares = apportion([float(s) for s in sizes], budget, sizes)
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        return torch.cat([torch.arange(s, s + k) for s, k in zip(starts, shares)]) if budget else torch.zeros(0, dtype=torch.long)


class Random(RefreshPolicy):
    name = "random"

    def select(self, tokens, budget, scores, options):
        generator = torch.Generator().manual_seed(options.seed)
        return torch.sort(torch.randperm(tokens.n, generator=generator)[:budget]).values


class Attention(RefreshPolicy):
    name = "attention"
    uses_scores = True

    def select(self, tokens, budget, scores, options):
        return top_k_indices(scores.attention().mean(0), budget).cpu()


class Conduit(RefreshPolicy):
    name = "conduit"
    uses_scores = True

    def select(self, tokens, budget, scores, options):
        per_token = (scores.attention() * scores.value_norms()).mean(0)  # s(t) = mean_l a_l(t) ||V_l(t)||
        amplified = amplify(per_token, tokens.image, tokens.n_images, options.lam)
        return top_k_indices(amplified, budget).cpu()


class CacheBlend(RefreshPolicy):
    """Selected inside the recompute pass, layer by layer (see reuse.py); ``layer_counts`` says how
    many visual tokens each layer recomputes."""

    name = "cacheblend"
    layerwise = True

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

    def select(self, tokens, budget, scores, options):
        raise RuntimeError("cacheblend selects inside the recompute pass (reuse.recompute_layerwise)")


POLICIES: dict[str, RefreshPolicy] = {p.name: p for p in (Full(), NoRefresh(), First(), Random(), Attention(),
                                                            CacheBlend(), Conduit())}


def get_policy(name: str) -> RefreshPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise RequestError(f"unknown refresh policy {name!r}; use one of {sorted(POLICIES)}") from None
