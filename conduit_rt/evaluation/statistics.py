"""Confidence intervals and paired comparisons of per-request outcomes (docs/methods.md §4).

Every setting of ``conduit eval`` answers the same requests, so its outcomes are a bool per request,
aligned with every other setting's by position. From those lists:

- ``wilson_interval``: the Wilson score interval of an accuracy (a binomial proportion). Unlike
  the normal approximation it stays inside [0, 1] and keeps its coverage near 0% and 100%;
- ``ratio_interval``: a percentile bootstrap over requests of 100 x mean(a) / mean(b), the "% of
  full" of a setting against the reference answered on the same requests (the ratio of two paired
  means has no simple closed-form interval);
- ``paired_difference``: a percentile bootstrap over requests of mean(a) - mean(b) for two settings
  answered on the same requests. Resampling requests (not each setting on its own) keeps the
  pairing, so the request-to-request variation that both settings share cancels in the difference.

The bootstrap is seeded (``numpy.random.default_rng(seed)``): the same outcomes, resample count and
seed give the same interval. Resamples are drawn in chunks of at most ``CHUNK_DRAWS`` counts so that
memory stays bounded for any number of requests.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
CHUNK_DRAWS = 1 << 22  # multinomial counts held at once (32 MiB of int64)

Interval = tuple[float, float]


def z_score(confidence: float = CONFIDENCE) -> float:
    """The standard normal quantile of a two-sided interval: 1.96 at 0.95."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), not {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, n: int, confidence: float = CONFIDENCE) -> Interval:
    """The Wilson score interval of ``successes`` out of ``n``, as fractions in [0, 1].

    center = (p + z²/2n) / (1 + z²/n), half-width = z / (1 + z²/n) * sqrt(p(1 - p)/n + z²/4n²), with
    p = successes / n. No requests (n = 0) carry no information: [0, 1].
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    z = z_score(confidence)
    p = successes / n
    scale = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / scale
    half = z / scale * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, float(center - half)), min(1.0, float(center + half))


def as_samples(*samples: Sequence[bool] | Sequence[float] | np.ndarray) -> list[np.ndarray]:
    """Paired samples as float64 arrays [n] of one length (ValueError if the lengths differ)."""
    arrays = [np.asarray(sample, dtype=np.float64).reshape(-1) for sample in samples]
    lengths = {len(array) for array in arrays}
    if len(lengths) > 1:
        raise ValueError(f"paired samples must cover the same requests, got lengths {sorted(lengths)}")
    return arrays


def bootstrap_means(samples: Sequence[np.ndarray], resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """The means of paired samples over ``resamples`` bootstrap resamples of the requests:
    float64 [resamples, len(samples)].

    ``samples``: paired arrays [n]. A resample draws n requests with replacement and takes every
    sample at the same requests, so pairs stay together. Requests with the same values in every
    sample are interchangeable, so a resample is drawn as how many times each distinct value tuple
    comes up: multinomial counts with the tuples' frequencies, the same distribution as drawing
    request indices, and for bools (at most 2^len(samples) tuples) a few draws per resample
    instead of n.
    """
    samples = as_samples(*samples)
    n = len(samples[0])
    if n == 0:
        raise ValueError("cannot resample an empty sample")
    if resamples < 1:
        raise ValueError(f"resamples must be positive, not {resamples}")
    values, counts = np.unique(np.stack(samples, axis=1), axis=0, return_counts=True)  # [k, s], [k]
    rng = np.random.default_rng(seed)
    chunk = max(1, CHUNK_DRAWS // len(values))
    means = []
    for start in range(0, resamples, chunk):
        draws = rng.multinomial(n, counts / n, size=min(chunk, resamples - start))  # [chunk, k]
        means.append(draws @ values / n)
    return np.concatenate(means)


def percentile_interval(values: np.ndarray, confidence: float = CONFIDENCE) -> Interval | None:
    """The central ``confidence`` interval of bootstrap values, NaNs (undefined resamples) left out;
    None when every value is NaN."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return None
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def ratio_interval(outcomes: Sequence[bool], reference: Sequence[bool], confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES, seed: int = SEED) -> Interval | None:
    """Percentile bootstrap interval of 100 x accuracy(outcomes) / accuracy(reference), in percent.

    Both lists hold one bool per request, the same requests in the same order. Resamples in which
    the reference gets nothing right have no ratio and are left out; None when there are no
    requests or the reference never answers right.
    """
    a, b = as_samples(outcomes, reference)
    if len(a) == 0 or not b.any():
        return None
    means = bootstrap_means((a, b), resamples, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(means[:, 1] > 0, 100.0 * means[:, 0] / means[:, 1], np.nan)
    return percentile_interval(ratios, confidence)


@dataclass(frozen=True, slots=True)
class PairedDifference:
    """mean(a) - mean(b) over ``n`` paired requests and its bootstrap interval [low, high] (fractions)."""

    n: int
    difference: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly above or wholly below 0 (the settings differ at that confidence)."""
        return self.low > 0.0 or self.high < 0.0

    def as_dict(self) -> dict:
        return {"n": self.n, "difference": self.difference, "ci": [self.low, self.high],
                "excludes_zero": self.excludes_zero}


def paired_difference(a: Sequence[bool] | Sequence[float], b: Sequence[bool] | Sequence[float],
                      confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                      seed: int = SEED) -> PairedDifference | None:
    """The difference of the means of two paired samples (one value per request, same order) with a
    percentile bootstrap interval over requests; None when there are no requests."""
    a, b = as_samples(a, b)
    if len(a) == 0:
        return None
    means = bootstrap_means((a, b), resamples, seed)
    interval = percentile_interval(means[:, 0] - means[:, 1], confidence)
    assert interval is not None  # a difference of means is always defined
    return PairedDifference(len(a), float(a.mean() - b.mean()), *interval)
