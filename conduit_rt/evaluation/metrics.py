"""Quality measures of one answer against the full-prefill reference, and their means (docs/methods.md §4).

Every setting answers the same request greedily; its ``Outcome`` holds the generated tokens, the
logits of every step and the final hidden state that produced them. Fidelity compares an outcome
with the reference outcome (a cold full prefill of the same request on the same model):

- next-token KL divergence KL(p_full || p_policy), in nats, of the next-token distributions;
- top-1 agreement: whether both distributions have the same most likely token;
- greedy-continuation exact match: whether the whole greedy answer (tokens) is the same;
- relative error of the last hidden state: ||h - h_full||_2 / ||h_full||_2, with h the final
  norm's output (what the LM head reads; transformers' ``last_hidden_state``) at the token whose
  next-token distribution is compared.

Each per-step measure is given twice: at step 0 (the distribution right after the prompt, where a
refresh policy acts: ``*_first``) and as the mean over the *aligned* steps, the decode steps whose
preceding generated tokens equal the reference's (step 0 always; a compression policy changes only
these later steps, its step 0 is the untouched prefill).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from . import statistics


@dataclass(slots=True)
class Outcome:
    """One greedy answer of one setting to one request.

    logits: float32 [steps, vocab], step 0 = the distribution after the prompt; hidden: float32
    [steps, hidden], the final norm's output that produced each row of ``logits``.
    """

    text: str
    tokens: list[int]
    logits: torch.Tensor
    hidden: torch.Tensor
    stats: object  # conduit_rt.results.GenerationStats


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) per row, in nats: [..., vocab] -> [...] float64."""
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def relative_error(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """||value - reference|| / ||reference|| per row: [..., d] -> [...] float64."""
    reference, value = reference.double(), value.double()
    return (value - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)


def aligned_steps(reference: Outcome, outcome: Outcome) -> int:
    """How many leading steps are comparable: step s counts while the tokens before it agree."""
    agree = 0
    for mine, theirs in zip(outcome.tokens, reference.tokens):
        if mine != theirs:
            break
        agree += 1
    return max(1, min(agree + 1, reference.logits.shape[0], outcome.logits.shape[0]))


def fidelity(reference: Outcome, outcome: Outcome) -> dict[str, float]:
    """The §4 measures of ``outcome`` against ``reference`` (see the module docstring)."""
    steps = aligned_steps(reference, outcome)
    kl = kl_divergence(reference.logits[:steps], outcome.logits[:steps])
    top1 = (reference.logits[:steps].argmax(-1) == outcome.logits[:steps].argmax(-1)).double()
    hidden = relative_error(reference.hidden[:steps], outcome.hidden[:steps])
    return {
        "kl_first": float(kl[0]), "kl": float(kl.mean()),
        "top1_first": float(top1[0]), "top1": float(top1.mean()),
        "hidden_rel_error_first": float(hidden[0]), "hidden_rel_error": float(hidden.mean()),
        "continuation_match": float(outcome.tokens == reference.tokens),
        "aligned_steps": float(steps),
    }


def is_correct(text: str, answer: str) -> bool:
    """Exact match of the stripped answer text (the task's metric, ``conduit_rt.evaluation.task.evaluate.exact_match``)."""
    return text.strip() == answer


def accuracy_cells(correct: Sequence[bool], reference: Sequence[bool] | None) -> dict:
    """Accuracy of one setting over some requests with its 95% Wilson interval, and as % of the
    reference's accuracy on the same requests (``reference``: one bool per request, same order)
    with a paired bootstrap interval; the % fields are None without a reference or when it never
    answers right. Intervals are [low, high] lists (fractions for accuracy, percent for % of full)."""
    n, hits = len(correct), sum(correct)
    full = sum(reference) / len(reference) if reference else 0.0
    ratio = statistics.ratio_interval(correct, reference) if reference and full else None
    return {"n": n, "accuracy": hits / n if n else 0.0,
            "accuracy_ci": list(statistics.wilson_interval(hits, n)),
            "accuracy_pct_of_full": 100.0 * (hits / n) / full if n and full else None,
            "accuracy_pct_of_full_ci": list(ratio) if ratio is not None else None}


@dataclass(slots=True)
class SettingScores:
    """Per-request measures of one setting, summed as requests come in (``summary`` gives means).

    Every list holds one entry per request, in the order the requests were replayed: the lists of
    two settings that answered the same requests are paired by position.
    """

    correct: list[bool] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    measures: dict[str, list[float]] = field(default_factory=dict)

    def add(self, correct: bool, num_pages: int, measures: dict[str, float], family: str = "lookup") -> None:
        """One request's outcome; ``family``: the request's task family."""
        self.correct.append(correct)
        self.pages.append(num_pages)
        self.families.append(family)
        for name, value in measures.items():
            self.measures.setdefault(name, []).append(value)

    def extend(self, other: SettingScores) -> None:
        """Adds another shard's requests (``other`` measured the same setting)."""
        self.correct += other.correct
        self.pages += other.pages
        self.families += other.families
        for name, values in other.measures.items():
            self.measures.setdefault(name, []).extend(values)

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / self.n if self.n else 0.0

    def accuracy_by_pages(self) -> dict[str, float]:
        table: dict[int, list[bool]] = {}
        for hit, pages in zip(self.correct, self.pages):
            table.setdefault(pages, []).append(hit)
        return {str(pages): round(sum(hits) / len(hits), 4) for pages, hits in sorted(table.items())}

    def family_positions(self) -> dict[str, list[int]]:
        """The positions of each task family's requests, families in sorted order."""
        table: dict[str, list[int]] = {}
        for position, family in enumerate(self.families):
            table.setdefault(family, []).append(position)
        return dict(sorted(table.items()))

    def accuracy_by_family(self) -> dict[str, float]:
        """Accuracy over each task family's requests."""
        return {family: sum(self.correct[p] for p in positions) / len(positions)
                for family, positions in self.family_positions().items()}

    def summary(self, reference: SettingScores | None) -> dict:
        """Means over the requests, and accuracy with its 95% interval, also as % of ``reference``'s
        accuracy (the full prefill, answered on the same requests), overall and per task family
        (``families``: family -> ``accuracy_cells``)."""
        if reference is not None and reference.n != self.n:
            raise ValueError(f"the reference answered {reference.n} requests, this setting {self.n}: "
                             "they must answer the same requests")
        full = reference.correct if reference is not None else None
        out = accuracy_cells(self.correct, full)
        out["accuracy_by_pages"] = self.accuracy_by_pages()
        out["accuracy_by_family"] = self.accuracy_by_family()
        out["families"] = {family: accuracy_cells([self.correct[p] for p in positions],
                                                  [full[p] for p in positions] if full is not None else None)
                           for family, positions in self.family_positions().items()}
        out.update({name: mean(values) for name, values in self.measures.items()})
        return out


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def tail_summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, 99th percentile and maximum of per-request values (all 0 without requests): a small
    mean can hide the few requests that an error does change."""
    if not values:
        return {"mean": 0.0, "p99": 0.0, "max": 0.0}
    return {"mean": mean(values), "p99": float(np.percentile(values, 99)), "max": float(max(values))}
