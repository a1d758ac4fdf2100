"""Refresh policies: which cached (stale) visual tokens a request recomputes, all under one budget.

Every policy gets the same ``RefreshContext`` after the text pass (the restored visual tokens, the
budget ``ceil(r * N_vis)``, lazy scores, the options) and returns the last prompt token's logits.
docs/methods.md §1 defines each one; ``conduit`` is the method, the others are baselines:

  full        every visual token (the quality reference)
  none        nothing: reuse the restored KV as is
  first       the first tokens of each image, apportioned by image size (MPIC/EPIC-style)
  random      uniformly random tokens (seeded)
  attention   attention mass of the query rows, no value norm, no amplification (ProphetKV-style)
  cacheblend  layer-wise: every token on layers 0-1, then the top tokens by ||dK|| + ||dV|| per layer,
              counts decaying linearly with mean = budget (its own recompute: ``cacheblend.py``)
  conduit     attention mass x value norm, layer mean, image-level amplification, one global top-k

Beyond the papers (``beyond.py``): conduit_allq, conduit_rescore, conduit_deviation, conduit_focus,
conduit_local.
"""
from __future__ import annotations

from ..errors import RequestError
from .base import (  # noqa: F401
    FILL_MODES,
    LayerObserver,
    PromptRows,
    RefreshContext,
    Refreshed,
    RefreshOptions,
    RefreshPolicy,
    ScoreSource,
    VisualTokens,
)
from .beyond import ConduitAllQ, ConduitDeviation, ConduitFocus, ConduitLocal, ConduitRescore
from .cacheblend import CacheBlend
from .policies import Attention, Conduit, First, Full, NoRefresh, Random, amplify  # noqa: F401

POLICIES: dict[str, RefreshPolicy] = {p.name: p for p in (Full(), NoRefresh(), First(), Random(), Attention(),
                                                            CacheBlend(), Conduit(), ConduitAllQ(),
                                                            ConduitRescore(), ConduitDeviation(), ConduitFocus(),
                                                            ConduitLocal())}


def get_policy(name: str) -> RefreshPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise RequestError(f"unknown refresh policy {name!r}; use one of {sorted(POLICIES)}") from None
