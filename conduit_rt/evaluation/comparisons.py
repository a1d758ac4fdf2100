"""The paired comparisons of the quality report: which settings are set against which.

At every refresh budget measured, CONDUIT against ``attention`` (CONDUIT's score without value
norms and image amplification, docs/methods.md §1) and against the best other refresh baseline; at
every keep ratio measured, VL-Cache against the best other compression policy; and each policy
beyond the papers (``BEYOND``) against the method of its family and against the same best baseline. "Best" is the baseline with the highest accuracy at that
budget or keep ratio on these requests (ties: the first measured); ``full`` and
``none`` are not baselines (they bound every policy from above and below), nor is compression
``none`` (the whole cache). Choosing the best on the same requests favours the baseline, so a
difference that excludes zero against it is, if anything, understated.

Each comparison is a ``statistics.paired_difference`` of exact match over the same requests, with
its 95% bootstrap interval; ``excludes_zero`` says whether the two settings differ at that
confidence. With ``--kv-dtype`` the full prefill on that KV cache is set against the dense one
(``kv_comparison``): the same paired difference, and the first answer token's KL over requests.
results.json also keeps every setting's per-request outcomes (``outcomes``), so any two
settings of a run can be paired afterwards:

    python -m conduit_rt.evaluation.comparisons results.json refresh:conduit_focus@0.1 refresh:attention@0.1
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from .metrics import SettingScores, accuracy_cells, tail_summary
from .replay import REFERENCE_KEY, Setting
from .statistics import paired_difference

REFRESH_METHOD, COMPRESS_METHOD = "conduit", "vlcache"
REFRESH_RIVAL = "attention"  # the method's own ablation: its score without value norms and amplification
# the policies beyond the papers (docs/methods.md): compared with the method, never its baselines
BEYOND = {"refresh": {"conduit_allq", "conduit_rescore", "conduit_deviation", "conduit_focus", "conduit_local"},
          "compress": {"vlcache_all", "vlcache_flat", "vlcache_draft"}}
KV_TOLERANCE_POINTS = 0.5  # exact-match points a KV dtype may lose against the dense cache and still keep its quality
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
                if best is not None:
                    out.append(compare(f"{_policy(challenger)} vs best baseline ({_policy(best)})", kind, level,
                                       challenger, best, scores))
    return [entry for entry in out if entry is not None]


def kv_comparison(settings: Sequence[Setting], scores: dict[str, SettingScores]) -> dict | None:
    """The full prefill on the ``kv`` setting's cache against the dense one over the same requests
    (results.json's ``kv_cache``): its exact match (``metrics.accuracy_cells``), the paired difference
    with its interval, whether that lies within ``KV_TOLERANCE_POINTS``, and the mean, 99th
    percentile and maximum of the first answer token's KL(dense || kv) in nats. None without a
    ``kv`` setting or requests."""
    kv = next((setting for setting in settings if setting.kind == "kv"), None)
    if kv is None:
        return None
    mine, dense = scores[kv.key], scores[REFERENCE_KEY]
    difference = paired_difference(mine.correct, dense.correct)
    if difference is None:
        return None
    return {"key": kv.key, "kv_dtype": kv.kv_dtype, **accuracy_cells(mine.correct, dense.correct),
            "full_accuracy": dense.accuracy, **difference.as_dict(), "tolerance_points": KV_TOLERANCE_POINTS,
            "within_tolerance": abs(100 * difference.difference) <= KV_TOLERANCE_POINTS,
            "kl_first": tail_summary(mine.measures.get("kl_first", []))}


def outcomes(scores: dict[str, SettingScores]) -> dict[str, str]:
    """Each setting's per-request exact match as a string of 0s and 1s, in replay order (results.json)."""
    return {key: "".join("1" if correct else "0" for correct in score.correct) for key, score in scores.items()}


def pair_from_results(results: dict, a: str, b: str) -> dict:
    """The paired difference a - b (exact match over the same requests) from a results dict's
    ``outcomes``; KeyError names a setting the run did not measure."""
    found = results.get("outcomes", {})
    for key in (a, b):
        if key not in found:
            raise KeyError(f"{key!r} is not in the run's outcomes; measured: {', '.join(sorted(found)) or 'none'}")
    difference = paired_difference([c == "1" for c in found[a]], [c == "1" for c in found[b]])
    if difference is None:
        raise KeyError(f"{a!r} and {b!r} answered no requests")
    return {"a": a, "b": b, **difference.as_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conduit_rt.evaluation.comparisons",
                                     description="Pair two settings of a `conduit eval` run over the same requests.")
    parser.add_argument("results", type=Path, help="results.json of a `conduit eval` run")
    parser.add_argument("a", help="a setting key, e.g. refresh:conduit_focus@0.1")
    parser.add_argument("b", help="the setting to subtract, e.g. refresh:attention@0.1")
    args = parser.parse_args(argv)
    try:
        pair = pair_from_results(json.loads(args.results.read_text()), args.a, args.b)
    except KeyError as error:
        parser.error(str(error.args[0]))
    low, high = pair["ci"]
    print(f"{args.a} - {args.b}: {100 * pair['difference']:+.1f} points "
          f"[{100 * low:+.1f}, {100 * high:+.1f}] over {pair['n']} requests "
          f"({'CI excludes 0' if pair['excludes_zero'] else 'CI includes 0'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
