"""The refresh policies that select once and recompute in one pass (docs/methods.md §1): CONDUIT
and its one-pass baselines."""
from __future__ import annotations

import torch

from ..selection import apportion, top_k_indices
from .base import RefreshOptions, RefreshPolicy, ScoreSource, VisualTokens


def amplify(scores: torch.Tensor, image: torch.Tensor, n_images: int, lam: float) -> torch.Tensor:
    """Image-level relevance amplification (docs/methods.md §1 step 6): s'(t) = c_j(t) * s(t),
    c_j = 1 + λ (m_j / mean m - 1), m_j = mean over image j's tokens of max(s, 0). One image: c = 1.

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


class Full(RefreshPolicy):
    """Every visual token (the quality reference)."""

    name = "full"

    def select(self, tokens, budget, scores, options):
        return torch.arange(tokens.n)


class NoRefresh(RefreshPolicy):
    """Nothing: the restored KV is reused as is."""

    name = "none"

    def select(self, tokens, budget, scores, options):
        return torch.zeros(0, dtype=torch.long)


class First(RefreshPolicy):
    """The first tokens of each image, the budget apportioned by image size (MPIC/EPIC-style)."""

    name = "first"

    def select(self, tokens, budget, scores, options):
        sizes = torch.bincount(tokens.image.cpu(), minlength=tokens.n_images).tolist()
        shares = apportion([float(s) for s in sizes], budget, sizes)
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        return torch.cat([torch.arange(s, s + k) for s, k in zip(starts, shares)]) if budget else torch.zeros(0, dtype=torch.long)


class Random(RefreshPolicy):
    """Uniformly random tokens, seeded by ``options.seed``."""

    name = "random"

    def select(self, tokens, budget, scores, options):
        generator = torch.Generator().manual_seed(options.seed)
        return torch.sort(torch.randperm(tokens.n, generator=generator)[:budget]).values


class Attention(RefreshPolicy):
    """Attention mass of the query rows, no value norm, no amplification (ProphetKV-style)."""

    name = "attention"
    uses_scores = True

    def select(self, tokens, budget, scores, options):
        return top_k_indices(scores.attention().mean(0), budget).cpu()


class Conduit(RefreshPolicy):
    """Attention mass x value norm, layer mean, image-level amplification, one global top-k
    (docs/methods.md §1 steps 5-7)."""

    name = "conduit"
    uses_scores = True

    def select(self, tokens, budget, scores, options):
        return top_k_indices(conduit_scores(tokens, scores, options), budget).cpu()


def conduit_scores(tokens: VisualTokens, scores: ScoreSource, options: RefreshOptions) -> torch.Tensor:
    """s'(t) of docs/methods.md §1 steps 5-6: float32 [N] on the scores' device."""
    per_token = (scores.attention() * scores.value_norms()).mean(0)  # s(t) = mean_l a_l(t) ||V_l(t)||
    return amplify(per_token, tokens.image, tokens.n_images, options.lam)
