"""Refresh policies beyond the papers (docs/methods.md, "Policies beyond the papers"): CONDUIT's score
with more query rows, re-scored after a partial refresh, or weighted by a one-layer KV deviation.

CONDUIT scores the restored visual tokens with the question's attention over stale keys, which can
point at the wrong tokens; each policy here attacks that under the same budget B = ceil(r * N_vis):

  conduit_allq       CONDUIT with Q every text token from the first image on
  conduit_rescore    CONDUIT picks ceil(B/2) tokens, they are recomputed, the question's attention over
                     the partly refreshed KV picks the other B - ceil(B/2), then one pass over all B
  conduit_deviation  CONDUIT's score times ||dK|| + ||dV|| at layer 1 after recomputing every visual
                     token through layer 0
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from ..selection import top_k_indices
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
