"""Selection helpers shared by the refresh and the compression policies: budgets, their
apportioning, and top-k through the native library (``topk.py``)."""
from __future__ import annotations

import math

import torch

from . import topk
from .errors import RequestError


def budget_tokens(ratio: float, n_visual: int) -> int:
    """B = ceil(r * N_vis) (docs/methods.md §1 step 7), robust to float error (0.1 * 30 is 3, not 4)."""
    if not 0.0 <= ratio <= 1.0:
        raise RequestError(f"refresh_budget must be in [0, 1], got {ratio}")
    return min(n_visual, math.ceil(round(ratio * n_visual, 9)))


def keep_budget(ratio: float, m: int, n_layers: int) -> int:
    """round(α · m · L): the prompt tokens kept over every layer (docs/methods.md §2 step 3)."""
    if not 0.0 <= ratio <= 1.0:
        raise RequestError(f"keep must be in [0, 1], got {ratio}")
    return min(m * n_layers, round(ratio * m * n_layers))


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
