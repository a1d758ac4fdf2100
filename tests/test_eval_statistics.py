"""The quality report's statistics against independent references: the Wilson interval as the roots
of its defining quadratic (z from math.erf), bootstrap intervals against normal-approximation
standard errors and against the truth of synthetic paired data built to have it, the paired
comparisons recovering a planted difference, and the per-family scores against direct counts."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conduit_rt.evaluation.comparisons import main as comparisons_main
from conduit_rt.evaluation.comparisons import outcomes, pair_from_results, paired_comparisons
from conduit_rt.evaluation.metrics import SettingScores
from conduit_rt.evaluation.replay import REFERENCE_KEY, build_settings
from conduit_rt.evaluation.report import tables_markdown
from conduit_rt.evaluation.statistics import (
    bootstrap_means,
    paired_difference,
    ratio_interval,
    wilson_interval,
    z_score,
)


def normal_quantile_by_bisection(probability: float) -> float:
    """The standard normal quantile from math.erf, by bisection (independent of statistics.NormalDist)."""
    low, high = -10.0, 10.0
    for _ in range(200):
        middle = (low + high) / 2
        if 0.5 * (1 + math.erf(middle / math.sqrt(2))) < probability:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def wilson_by_quadratic(successes: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson interval as the set of p with (p_hat - p)^2 <= z^2 p (1 - p) / n: the roots of
    (1 + z²/n) p² - (2 p_hat + z²/n) p + p_hat² = 0."""
    p_hat = successes / n
    roots = np.roots([1 + z * z / n, -(2 * p_hat + z * z / n), p_hat * p_hat]).real
    return float(roots.min()), float(roots.max())


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_z_score_matches_the_erf_quantile(confidence):
    assert z_score(confidence) == pytest.approx(normal_quantile_by_bisection(0.5 + confidence / 2), abs=1e-9)


@pytest.mark.parametrize(("successes", "n"), [(0, 1), (1, 1), (0, 20), (20, 20), (7, 20), (305, 500), (1, 2000)])
def test_wilson_interval_is_the_root_pair_of_its_quadratic(successes, n):
    z = normal_quantile_by_bisection(0.975)
    low, high = wilson_interval(successes, n)
    expected_low, expected_high = wilson_by_quadratic(successes, n, z)
    assert low == pytest.approx(max(0.0, expected_low), abs=1e-9)
    assert high == pytest.approx(min(1.0, expected_high), abs=1e-9)
    assert 0.0 <= low <= successes / n <= high <= 1.0


def test_wilson_interval_covers_a_known_rate_about_95_percent_of_the_time():
    rng = np.random.default_rng(11)
    rate, n, trials = 0.3, 60, 4000
    hits = rng.binomial(n, rate, size=trials)
    covered = sum(low <= rate <= high for low, high in (wilson_interval(int(h), n) for h in hits))
    assert 0.93 <= covered / trials <= 0.97


def test_wilson_interval_edges_and_bad_input():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(0, 50)[0] == 0.0 and wilson_interval(50, 50)[1] == 1.0
    for successes, n in ((3, 2), (-1, 4), (0, -1)):
        with pytest.raises(ValueError):
            wilson_interval(successes, n)
    with pytest.raises(ValueError):
        z_score(1.0)


def correlated_pairs(rng: np.random.Generator, n: int, rate_a: float, rate_b: float) -> tuple[np.ndarray, np.ndarray]:
    """Paired outcomes with known rates: b = (u < rate_b), a = (u < rate_a) with one uniform u per
    request, so a and b agree wherever they can and mean(a) - mean(b) has expectation rate_a - rate_b."""
    u = rng.random(n)
    return u < rate_a, u < rate_b


def test_bootstrap_means_have_the_moments_of_resampling_requests():
    """Resampling n requests with replacement gives means with expectation the sample mean and
    covariance cov(x, y) / n (population covariance): for floats (every request distinct) and for
    correlated bools (four distinct pairs)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=300)
    a, b = correlated_pairs(rng, 300, 0.7, 0.4)
    for first, second in ((x, 2 * x + rng.normal(size=300)), (a, b)):
        first, second = np.asarray(first, float), np.asarray(second, float)
        means = bootstrap_means([first, second], resamples=4000, seed=2)
        expected = np.cov(np.stack([first, second]), ddof=0) / 300
        np.testing.assert_allclose(np.cov(means.T), expected, rtol=0.08)
        spread = np.sqrt(np.diag(expected) / 4000)
        assert np.all(np.abs(means.mean(axis=0) - [first.mean(), second.mean()]) < 4 * spread)


def test_paired_difference_interval_matches_the_normal_approximation():
    """Built so the observed difference is exactly 0.2: a right on the first 70% of requests, b on the first 50%."""
    n = 2000
    a = np.arange(n) < 0.7 * n
    b = np.arange(n) < 0.5 * n
    result = paired_difference(a, b)
    assert result.n == n and result.difference == pytest.approx(0.2, abs=1e-12)
    d = a.astype(float) - b.astype(float)
    half_width = normal_quantile_by_bisection(0.975) * d.std() / math.sqrt(n)
    assert result.low < 0.2 < result.high and result.excludes_zero
    assert (result.high - result.low) / 2 == pytest.approx(half_width, rel=0.1)


def test_paired_difference_interval_covers_the_true_difference():
    rng = np.random.default_rng(3)
    truth, trials, covered = 0.65 - 0.55, 300, 0
    for trial in range(trials):
        a, b = correlated_pairs(rng, 150, 0.65, 0.55)
        result = paired_difference(a, b, resamples=400, seed=trial)
        covered += result.low <= truth <= result.high
    assert 0.9 <= covered / trials <= 0.99


def test_paired_difference_recovers_a_planted_difference_and_not_a_missing_one():
    rng = np.random.default_rng(5)
    b = rng.random(1000) < 0.5
    a = b.copy()
    wrong = np.flatnonzero(~b)
    a[wrong[: 100]] = True  # 100 of 1000 requests planted right: +0.1
    planted = paired_difference(a, b)
    assert planted.difference == pytest.approx(0.1, abs=1e-12)
    assert planted.excludes_zero and planted.low > 0 and planted.low < 0.1 < planted.high
    same = paired_difference(b, b.copy())
    assert (same.difference, same.low, same.high, same.excludes_zero) == (0.0, 0.0, 0.0, False)


def test_paired_difference_flags_equal_rates_rarely():
    rng = np.random.default_rng(9)
    flagged = 0
    for trial in range(200):
        a, b = rng.random(120) < 0.6, rng.random(120) < 0.6  # same rate, independent answers
        flagged += paired_difference(a, b, resamples=400, seed=trial).excludes_zero
    assert flagged / 200 <= 0.1


def test_bootstrap_is_deterministic_in_its_seed():
    rng = np.random.default_rng(0)
    a, b = correlated_pairs(rng, 300, 0.7, 0.4)
    assert paired_difference(a, b, seed=4) == paired_difference(a, b, seed=4)
    assert ratio_interval(a, b, seed=4) == ratio_interval(a, b, seed=4)
    means = bootstrap_means([a, b], resamples=50, seed=4)
    assert means.shape == (50, 2) and np.array_equal(means, bootstrap_means([a, b], resamples=50, seed=4))
    assert not np.array_equal(means, bootstrap_means([a, b], resamples=50, seed=5))


def test_degenerate_and_single_request_samples():
    assert paired_difference([True] * 30, [True] * 30).as_dict() == {"n": 30, "difference": 0.0, "ci": [0.0, 0.0],
                                                                     "excludes_zero": False}
    all_right = paired_difference([True] * 30, [False] * 30)
    assert (all_right.difference, all_right.low, all_right.high, all_right.excludes_zero) == (1.0, 1.0, 1.0, True)
    one = paired_difference([True], [False])
    assert (one.n, one.difference, one.low, one.high) == (1, 1.0, 1.0, 1.0)
    assert ratio_interval([True], [True]) == (100.0, 100.0)
    assert ratio_interval([False], [True]) == (0.0, 0.0)
    assert paired_difference([], []) is None and ratio_interval([], []) is None
    assert ratio_interval([True, False], [False, False]) is None  # the reference never right: no ratio
    with pytest.raises(ValueError):
        paired_difference([True, False], [True])


def test_ratio_interval_matches_the_delta_method():
    """A right on the first 60% of requests, the reference on the first 80%: the ratio is 75% by construction."""
    n = 2000
    a = np.arange(n) < 0.6 * n
    b = np.arange(n) < 0.8 * n
    low, high = ratio_interval(a, b)
    ratio = a.mean() / b.mean()
    residual = a.astype(float) - ratio * b.astype(float)
    half_width = 100 * normal_quantile_by_bisection(0.975) * residual.std() / (b.mean() * math.sqrt(n))
    assert low < 75.0 < high
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.1)
    assert ratio_interval(b, b) == pytest.approx((100.0, 100.0), abs=1e-9)


def scores_of(correct: list[bool], families: list[str]) -> SettingScores:
    scores = SettingScores()
    for hit, family in zip(correct, families):
        scores.add(hit, 2, {"kl": 0.5}, family)
    return scores


def test_summary_gives_intervals_overall_and_per_family():
    rng = np.random.default_rng(2)
    families = [["lookup", "where", "describe"][i % 3] for i in range(300)]
    full = scores_of(list(rng.random(300) < 0.9), families)
    setting = scores_of(list(rng.random(300) < 0.6), families)
    summary = setting.summary(full)
    assert summary["n"] == 300 and summary["kl"] == pytest.approx(0.5)
    hits = sum(setting.correct)
    assert summary["accuracy"] == pytest.approx(hits / 300)
    assert summary["accuracy_ci"] == list(wilson_interval(hits, 300))
    assert summary["accuracy_pct_of_full"] == pytest.approx(100 * hits / sum(full.correct))
    low, high = summary["accuracy_pct_of_full_ci"]
    assert low < summary["accuracy_pct_of_full"] < high
    assert list(summary["families"]) == sorted(set(families)) == list(setting.accuracy_by_family())
    for family, cells in summary["families"].items():
        mine = [hit for hit, f in zip(setting.correct, families) if f == family]
        theirs = [hit for hit, f in zip(full.correct, families) if f == family]
        assert cells["n"] == len(mine) == 100
        assert cells["accuracy"] == pytest.approx(sum(mine) / len(mine)) == setting.accuracy_by_family()[family]
        assert cells["accuracy_pct_of_full"] == pytest.approx(100 * sum(mine) / sum(theirs))
        assert cells["accuracy_ci"][0] <= cells["accuracy"] <= cells["accuracy_ci"][1]
    merged = SettingScores()
    merged.extend(setting)
    assert merged.families == families
    with pytest.raises(ValueError):
        setting.summary(scores_of([True], ["lookup"]))


def test_add_without_a_family_counts_as_lookup():
    scores = SettingScores()
    scores.add(True, 1, {})
    assert scores.accuracy_by_family() == {"lookup": 1.0}


def planted_scores(settings, rates: dict[str, float], n: int = 400) -> dict[str, SettingScores]:
    """Scores with one uniform per request shared by every setting: a setting is right where u < its rate."""
    u = np.random.default_rng(8).random(n)
    return {s.key: scores_of(list(u < rates.get(s.key, 0.5)), ["lookup"] * n) for s in settings}


def test_paired_comparisons_pick_the_pairs_and_the_best_baseline():
    settings = build_settings(["full", "none", "random", "attention", "cacheblend", "conduit"], [0.0, 0.1, 0.2],
                              ["none", "snapkv", "pyramidkv", "vlcache"], [0.1], together=None)
    rates = {REFERENCE_KEY: 0.95, "refresh:full@1": 0.95, "refresh:none@0": 0.2, "compress:none@1": 0.95,
             "refresh:random@0.1": 0.3, "refresh:attention@0.1": 0.5, "refresh:cacheblend@0.1": 0.6,
             "refresh:conduit@0.1": 0.8, "refresh:random@0.2": 0.7, "refresh:attention@0.2": 0.6,
             "refresh:cacheblend@0.2": 0.65, "refresh:conduit@0.2": 0.7,
             "compress:snapkv@0.1": 0.4, "compress:pyramidkv@0.1": 0.45, "compress:vlcache@0.1": 0.45}
    scores = planted_scores(settings, rates)
    found = {(c["a"], c["b"]): c for c in paired_comparisons(settings, scores)}
    assert list(found) == [("refresh:conduit@0.1", "refresh:attention@0.1"),
                           ("refresh:conduit@0.1", "refresh:cacheblend@0.1"),
                           ("refresh:conduit@0.2", "refresh:attention@0.2"),
                           ("refresh:conduit@0.2", "refresh:random@0.2"),
                           ("compress:vlcache@0.1", "compress:pyramidkv@0.1")]
    for (a, b), comparison in found.items():
        expected = np.mean(scores[a].correct) - np.mean(scores[b].correct)
        assert comparison["difference"] == pytest.approx(expected, abs=1e-12)
        assert comparison["n"] == 400
    assert found[("refresh:conduit@0.1", "refresh:attention@0.1")]["excludes_zero"]
    assert found[("refresh:conduit@0.2", "refresh:random@0.2")]["difference"] == 0.0  # same rate, same uniforms
    assert not found[("compress:vlcache@0.1", "compress:pyramidkv@0.1")]["excludes_zero"]
    assert found[("refresh:conduit@0.2", "refresh:random@0.2")]["label"] == "conduit vs best baseline (random)"


def test_report_shows_intervals_families_and_comparisons():
    settings = build_settings(["full", "none", "attention", "conduit"], [0.0, 0.1], ["none", "vlcache"], [0.1],
                              together=None)
    rates = {REFERENCE_KEY: 0.9, "refresh:full@1": 0.9, "refresh:none@0": 0.2, "refresh:attention@0.1": 0.5,
             "refresh:conduit@0.1": 0.7, "compress:none@1": 0.9, "compress:vlcache@0.1": 0.6}
    scores = planted_scores(settings, rates)
    measures = dict.fromkeys(("kl_first", "kl", "top1_first", "top1", "continuation_match", "hidden_rel_error",
                              "prefill_flops_ratio", "kv_ratio", "refreshed_fraction"), 0.5)
    rows = [{"key": s.key, "kind": s.kind, "refresh": s.refresh, "budget": s.budget, "compress": s.compress,
             "keep": s.keep, **scores[s.key].summary(scores[REFERENCE_KEY]), **measures} for s in settings]
    results = {"config": {"budgets": [0.0, 0.1], "keeps": [0.1], "min_pages": 1, "max_pages": 8, "seed": 0,
                          "seen": "sessions", "model_name": "m", "device": "cpu", "dtype": "float32", "max_tokens": 8},
               "n_requests": 400, "seconds": 1.0, "rows": rows, "comparisons": paired_comparisons(settings, scores),
               "checks": {"full_accuracy": 0.9, "none_gap_points": 70.0, "none_gap_points_ci": [65.0, 75.0],
                          "tells_policies_apart": True}}
    text = tables_markdown(results)
    conduit = rows[[s.key for s in settings].index("refresh:conduit@0.1")]
    low, high = conduit["accuracy_ci"]
    assert f"{100 * conduit['accuracy']:.1f} [{100 * low:.1f}, {100 * high:.1f}]" in text
    assert "### By task family" in text and "lookup (n = 400)" in text
    assert "| conduit vs attention | r = 10% |" in text and "| conduit vs best baseline (attention) |" in text
    assert "paired differences over the same requests: attention +" in text
    old = {**results, "rows": [{k: v for k, v in row.items() if "ci" not in k and "famil" not in k} for row in rows]}
    del old["comparisons"]
    assert "### Paired comparisons" not in tables_markdown(old)  # results without statistics still render


def test_policies_beyond_the_papers_are_set_against_the_method_and_never_count_as_baselines():
    settings = build_settings(["none", "attention", "conduit", "conduit_rescore"], [0.1], ["snapkv", "vlcache", "vlcache_all"],
                              [0.1], together=None)
    rates = {REFERENCE_KEY: 0.95, "refresh:none@0": 0.2, "refresh:attention@0.1": 0.5, "refresh:conduit@0.1": 0.6,
             "refresh:conduit_rescore@0.1": 0.9, "compress:snapkv@0.1": 0.4, "compress:vlcache@0.1": 0.45,
             "compress:vlcache_all@0.1": 0.7}
    scores = planted_scores(settings, rates)
    found = [(c["a"], c["b"], c["label"]) for c in paired_comparisons(settings, scores)]
    assert found == [  # the most accurate rows are the new policies, yet the best baselines are the papers'
        ("refresh:conduit@0.1", "refresh:attention@0.1", "conduit vs attention"),
        ("refresh:conduit@0.1", "refresh:attention@0.1", "conduit vs best baseline (attention)"),
        ("refresh:conduit_rescore@0.1", "refresh:conduit@0.1", "conduit_rescore vs conduit"),
        ("refresh:conduit_rescore@0.1", "refresh:attention@0.1", "conduit_rescore vs best baseline (attention)"),
        ("compress:vlcache@0.1", "compress:snapkv@0.1", "vlcache vs best baseline (snapkv)"),
        ("compress:vlcache_all@0.1", "compress:vlcache@0.1", "vlcache_all vs vlcache"),
        ("compress:vlcache_all@0.1", "compress:snapkv@0.1", "vlcache_all vs best baseline (snapkv)"),
    ]


def test_outcomes_let_any_two_settings_be_paired_afterwards(tmp_path, capsys):
    settings = build_settings(["none", "attention", "conduit"], [0.1], ["snapkv", "vlcache"], [0.1], together=None)
    rates = {REFERENCE_KEY: 0.95, "refresh:none@0": 0.2, "refresh:attention@0.1": 0.5, "refresh:conduit@0.1": 0.6,
             "compress:snapkv@0.1": 0.4, "compress:vlcache@0.1": 0.45}
    scores = planted_scores(settings, rates)
    results = {"outcomes": outcomes(scores)}
    assert set(results["outcomes"]) == set(scores) and all(len(v) == 400 for v in results["outcomes"].values())
    pair = pair_from_results(results, "refresh:none@0", "compress:vlcache@0.1")  # not a pair the report makes
    direct = paired_difference(scores["refresh:none@0"].correct, scores["compress:vlcache@0.1"].correct)
    assert pair["difference"] == pytest.approx(np.mean(scores["refresh:none@0"].correct)
                                               - np.mean(scores["compress:vlcache@0.1"].correct), abs=1e-12)
    assert pair["ci"] == [direct.low, direct.high] and pair["excludes_zero"] == direct.excludes_zero
    with pytest.raises(KeyError, match="refresh:conduit_focus@0.1"):
        pair_from_results(results, "refresh:conduit_focus@0.1", "refresh:attention@0.1")
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert comparisons_main([str(path), "refresh:conduit@0.1", "refresh:attention@0.1"]) == 0
    assert "over 400 requests" in capsys.readouterr().out
