"""The paired comparisons of the quality report: which settings are set against which.

At every refresh budget measured, CONDUIT against ``attention`` (CONDUIT's score without value
norms and image amplification, docs/methods.md §1) and against the best other refresh baseline; at
every keep ratio measured, VL-Cache against the best other compression policy; and each policy
beyond the papers (``BEYOND``) against the method of its family. "Best" is the baseline with the highest accuracy at that
budget or keep ratio on these requests (ties: the first measured); ``full`` and
``none`` are not baselines (they bound every policy from above and below), nor is compression
``none`` (the whole cache). Choosing the best on the same requests favours the baseline, so a
difference that excludes zero against it is, if anything, understated.

Each comparison is a ``statistics.paired_difference`` of exact match over the same requests, with
its 95% bootstrap interval; ``excludes_zero`` says whether the two settings differ at that
confidence.
"""
from __future__ import annotations

from collections.abc import Sequence

from .metrics import SettingScores
from .replay import Setting
from .statistics import paired_difference

REFRESH_METHOD, COMPRESS_METHOD = "conduit", "vlcache"
REFRESH_RIVAL = "attention"  # the method's own ablation: its score without value norms and amplification
# the policies beyond the papers (docs/methods.md): compared with the method, never its baselines
BEYOND = {"refresh": {"conduit_allq", "conduit_rescore", "conduit_deviation", "conduit_focus"}, "compress": {"vlcache_all"}}
NOT_BASELINES = {"refresh": {"full", "none", REFRESH_METHOD, *BEYOND["refresh"]},
                 "compress": {"none", COMPRESS_METHOD, *BEYOND["compress"]}}


def _level(setting: Setting) -> float:
    """The budget of a refresh setting, the keep ratio of a compression one."""
    return setting.budget if setting.kind == "refresh" else setting.keep


def _policy(setting: Setting) -> str | None:
    return setting.refresh if setting.kind == "refresh" else setting.compress


def compare(label: str, kind: str, level: float, a: Setting, b: Setting, scores: dict[str, SettingScores]) -> dict | None:
    """One comparison's results.json entry: a - b in exact match with its interval (None without requests)."""
    difference = paired_difference(scores[a.key].correct, scores[b.key].correct)
    if difference is None:
        return None
    return {"label": label, "kind": kind, "level": level, "a": a.key, "b": b.key,
            "accuracy_a": scores[a.key].accuracy, "accuracy_b": scores[b.key].accuracy, **difference.as_dict()}


def best_baseline(candidates: Sequence[Setting], scores: dict[str, SettingScores]) -> Setting | None:
    """The candidate with the highest accuracy (the first of equals), or None."""
    best = None
    for setting in candidates:
        if best is None or scores[setting.key].accuracy > scores[best.key].accuracy:
            best = setting
    return best


def paired_comparisons(settings: Sequence[Setting], scores: dict[str, SettingScores]) -> list[dict]:
    """Every comparison the report lists (see the module docstring), refresh budgets then keep ratios,
    each in increasing order."""
    out: list[dict | None] = []
    for kind, method in (("refresh", REFRESH_METHOD), ("compress", COMPRESS_METHOD)):
        measured = [s for s in settings if s.kind == kind and scores[s.key].n]
        for level in sorted({_level(s) for s in measured if _policy(s) == method}):
            at_level = [s for s in measured if _level(s) == level]
            ours = next(s for s in at_level if _policy(s) == method)
            baselines = [s for s in at_level if _policy(s) not in NOT_BASELINES[kind]]
            if kind == "refresh":
                rival = next((s for s in baselines if s.refresh == REFRESH_RIVAL), None)
                if rival is not None:
                    out.append(compare(f"{method} vs {REFRESH_RIVAL}", kind, level, ours, rival, scores))
            best = best_baseline(baselines, scores)
            if best is not None:
                out.append(compare(f"{method} vs best baseline ({_policy(best)})", kind, level, ours, best, scores))
            for challenger in (s for s in at_level if _policy(s) in BEYOND[kind]):
                out.append(compare(f"{_policy(challenger)} vs {method}", kind, level, challenger, ours, scores))
    return [entry for entry in out if entry is not None]
