"""KV compression for decoding (docs/methods.md §2): after prefill, keep per layer a budget of the prompt's
KV and give the rest back to the arena. Every policy sees the same ``PromptStats`` and keep ratio α
and returns, per layer, the sorted slots to keep:

  none          everything
  random        uniformly random tokens (seeded per layer)
  streamingllm  4 sink tokens + the most recent ones
  h2o           half heavy hitters (attention accumulated over every computed prompt query), half recent
  snapkv        the last 32 prompt queries' attention, summed over heads, avg-pooled (kernel 5); window kept
  pyramidkv     snapkv's scores with layer budgets falling linearly (bottom 2k - k/β, top k/β, β = 20)
  vlcache       layer budgets from each layer's post-vision attention density, then the tokens the
                post-vision queries attend to most (text and visual in one ranking); P itself kept
  vlcache_all   vlcache scored with every text token from the first image on; P itself kept (beyond the paper)
  vlcache_flat  vlcache's token scores with equal layer budgets; P itself kept (beyond the paper)
  vlcache_draft vlcache_flat's budgets; scores add the attention of a few decode steps drafted on the
                full cache (then dropped); only the prompt's last two tokens forced (beyond the paper)

Budgets: round(α · m · L) tokens in all, apportioned over layers by largest remainder (equal weights
unless the policy says otherwise). The attention statistics come from the native ``attention_stats``
kernel over the queries the prefill computed; no [n_q, m] matrix is built.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from . import validation
from .errors import RequestError
from .parallel.group import TensorParallelGroup
from .results import GenerationStats
from .selection import apportion, keep_budget, top_k_indices


@dataclass(frozen=True, slots=True)
class CompressOptions:
    """Knobs of compression (defaults from docs/methods.md §2)."""

    threshold: float = 0.01           # VL-Cache: entries below threshold x row max count as zero
    window: int = 32                  # SnapKV/PyramidKV observation window (and kept window)
    pool_kernel: int = 5              # SnapKV/PyramidKV average pooling
    sinks: int = 4                    # StreamingLLM
    pyramid_beta: float = 20.0        # PyramidKV steepness
    min_layer_ratio: float = 0.01     # VL-Cache clip of β_l
    recompress_every: int | None = None  # beyond the paper: re-compress every N decoded tokens
    draft_steps: int = 3              # vlcache_draft: decode steps drafted on the full cache to score with
    seed: int = 0

    def __post_init__(self) -> None:
        """Checks every field's type and range (RequestError)."""
        every = self.recompress_every
        fields = {
            "threshold": validation.real(self.threshold, "threshold", 0.0, 1.0),
            "window": validation.integer(self.window, "window", 1),
            "pool_kernel": validation.integer(self.pool_kernel, "pool_kernel", 1),
            "sinks": validation.integer(self.sinks, "sinks", 0),
            # PyramidKV's bottom layer gets (2 - 1/β) k: negative below β = 1/2
            "pyramid_beta": validation.real(self.pyramid_beta, "pyramid_beta", 0.5),
            "min_layer_ratio": validation.real(self.min_layer_ratio, "min_layer_ratio", 0.0, 1.0),
            "recompress_every": None if every is None else validation.integer(every, "recompress_every", 1),
            "draft_steps": validation.integer(self.draft_steps, "draft_steps", 1, 64),
            # the random policy seeds layer l with seed * 100003 + l, which must stay a valid seed
            "seed": validation.integer(self.seed, "seed", 0, 2**32 - 1),
        }
        if fields["pool_kernel"] % 2 == 0:  # padding kernel // 2 keeps the scores' length for odd kernels only
            raise RequestError(f"pool_kernel must be an odd integer >= 1, got {self.pool_kernel!r}")
        validation.set_fields(self, fields)


# ``draft(n_steps)``: greedy decode steps run on the full prompt cache and then dropped from it ->
# (q by layer, each [n_steps, n_heads, head_dim], and the steps' causal positions)
DraftQueries = Callable[[int], tuple[dict[int, torch.Tensor], list[int]]]


class PromptStats:
    """What the policies read about a prefilled prompt of m tokens, computed on demand per layer.

    ``queries(layer, positions)`` returns the q the prefill computed for those positions
    ([n, n_heads, head_dim]) and which positions it had; statistics come from
    ``Sequence.attention_stats`` over the layer's stored tokens (slot order). ``draft`` drafts decode
    steps for ``draft_mass`` (run at most once, before any layer is compacted).
    """

    def __init__(self, seq, n_layers: int, n_heads: int, scale: float, queries, post_vision: list[int],
                 options: CompressOptions, parallel: TensorParallelGroup | None = None,
                 draft: DraftQueries | None = None) -> None:
        self.seq, self.n_layers, self.n_heads, self.scale = seq, n_layers, n_heads, scale
        self.parallel = parallel  # tensor parallel: the statistics add up every rank's heads
        self.draft, self._drafted = draft, None
        self.queries, self.post_vision, self.options = queries, post_vision, options
        self.m = seq.n_tokens(0)
        self.sorted_positions = torch.sort(seq.positions(0).long()).values  # no layer compacted yet
        self._cache: dict[tuple[int, tuple[int, ...]], tuple] = {}

    def _stats(self, layer: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(mass float32 [m] on CPU, n_below float32 [n_heads], visible (query, key) pairs per head)."""
        cache_key = (layer, tuple(rows))
        if cache_key not in self._cache:
            q, found = self.queries(layer, rows)
            if not found:
                self._cache[cache_key] = (torch.zeros(self.m), torch.zeros(self.n_heads), 0.0)
            else:
                q_pos = torch.tensor(found, dtype=torch.int32, device=q.device)
                mass, n_below, _ = self.seq.attention_stats(layer, q, q_pos, self.scale, self.options.threshold)
                if self.parallel is not None:  # this rank's heads: the mass of all, every head's count
                    mass, n_below = self.parallel.all_reduce(mass), self.parallel.gather(n_below, dim=0)
                keys_seen = torch.searchsorted(self.sorted_positions, torch.tensor(found), right=True)
                self._cache[cache_key] = (mass.cpu(), n_below.cpu(), float(keys_seen.sum()))
        return self._cache[cache_key]

    def post_vision_mass(self, layer: int) -> torch.Tensor:
        return self._stats(layer, self.post_vision)[0]

    def density(self, layer: int) -> float:
        """d_l = 1 - mean over heads of the fraction of post-vision entries under threshold x row max."""
        _, n_below, visible = self._stats(layer, self.post_vision)
        return 1.0 - float((n_below / visible).mean()) if visible else 1.0

    def window_mass(self, layer: int) -> torch.Tensor:
        return self._stats(layer, list(range(max(0, self.m - self.options.window), self.m)))[0]

    def all_mass(self, layer: int) -> torch.Tensor:
        return self._stats(layer, list(range(self.m)))[0]

    def drafted_queries(self) -> tuple[dict[int, torch.Tensor], list[int]]:
        """The q of the ``options.draft_steps`` drafted decode steps by layer ([n_steps, n_heads,
        head_dim]) and their positions, drafted on the first call."""
        if self.draft is None:
            raise RequestError("this compression policy drafts decode steps, which this runtime cannot run")
        if self._drafted is None:
            self._drafted = self.draft(self.options.draft_steps)
        return self._drafted

    def draft_mass(self, layer: int) -> torch.Tensor:
        """float32 [m] on CPU: the attention the ``options.draft_steps`` drafted decode steps give each
        slot of the layer, summed over steps and heads."""
        q_by_layer, positions = self.drafted_queries()
        return decode_mass(self.seq, layer, q_by_layer[layer], positions, self.scale, self.parallel,
                           self.options.threshold).cpu()


def top_slots(scores: torch.Tensor, k: int, forced: list[int]) -> list[int]:
    """The ``forced`` slots plus the best-scoring others, k in all (sorted; ties to the lower slot)."""
    keep = sorted(set(forced))[:k]
    extra = max(0, min(k, scores.numel()) - len(keep))
    if extra:
        free = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
        if keep:
            free[torch.tensor(keep, device=scores.device)] = False
        candidates = torch.nonzero(free).flatten()
        keep += candidates[top_k_indices(scores[candidates], extra)].tolist()
    return sorted(keep)


class QueryRows(Protocol):
    """The prompt positions a policy may take as its query rows P (``request.Request``)."""

    def post_vision_positions(self) -> list[int]:
        """The tokens after the last image (no image: the last 32)."""

    def text_after_first_image(self) -> list[int]:
        """Every text token from the first image on."""


class CompressionPolicy:
    """Base: a named rule keeping, per layer, a budget of the prompt's slots."""

    name = ""

    def query_rows(self, prompt: QueryRows) -> list[int]:
        """The query rows P (``PromptStats.post_vision``), kept by the policies that read them."""
        return prompt.post_vision_positions()

    def observed_positions(self, n_prompt: int, post_vision: list[int], options: CompressOptions) -> list[int]:
        """Prompt positions whose final q the prefill must keep for ``keep`` (sorted): P and the
        observation window."""
        return sorted(set(post_vision) | set(range(max(0, n_prompt - options.window), n_prompt)))

    def layer_budgets(self, stats: PromptStats, ratio: float) -> list[int]:
        total = keep_budget(ratio, stats.m, stats.n_layers)
        return apportion([1.0] * stats.n_layers, total, [stats.m] * stats.n_layers)

    def keep(self, stats: PromptStats, ratio: float) -> list[list[int]]:
        """Per layer, the sorted slots to keep."""
        return [self.select(stats, layer, k) for layer, k in enumerate(self.layer_budgets(stats, ratio))]

    def select(self, stats: PromptStats, layer: int, k: int) -> list[int]:
        raise NotImplementedError


class KeepAll(CompressionPolicy):
    name = "none"

    def keep(self, stats, ratio):
        return [list(range(stats.m)) for _ in range(stats.n_layers)]


class RandomKeep(CompressionPolicy):
    name = "random"

    def select(self, stats, layer, k):
        generator = torch.Generator().manual_seed(stats.options.seed * 100003 + layer)
        return sorted(torch.randperm(stats.m, generator=generator)[:k].tolist())


class StreamingLLM(CompressionPolicy):
    name = "streamingllm"

    def select(self, stats, layer, k):
        sinks = min(stats.options.sinks, k)
        return sorted(set(range(sinks)) | set(range(stats.m - (k - sinks), stats.m)))


class H2O(CompressionPolicy):
    name = "h2o"

    def observed_positions(self, n_prompt, post_vision, options):
        return list(range(n_prompt))  # heavy hitters: the attention of every prompt query

    def select(self, stats, layer, k):
        recent = list(range(stats.m - k // 2, stats.m))
        return top_slots(stats.all_mass(layer), k, recent)


class SnapKV(CompressionPolicy):
    name = "snapkv"

    def select(self, stats, layer, k):
        kernel = stats.options.pool_kernel
        pooled = F.avg_pool1d(stats.window_mass(layer)[None, None], kernel, stride=1, padding=kernel // 2,
                              count_include_pad=False)[0, 0]
        window = list(range(max(0, stats.m - stats.options.window), stats.m))
        return top_slots(pooled, k, window)


class PyramidKV(SnapKV):
    name = "pyramidkv"

    def layer_budgets(self, stats, ratio):
        total, n_layers, beta = keep_budget(ratio, stats.m, stats.n_layers), stats.n_layers, stats.options.pyramid_beta
        top, bottom = 1.0 / beta, 2.0 - 1.0 / beta  # in units of the mean budget k
        weights = [bottom + (top - bottom) * layer / max(1, n_layers - 1) for layer in range(n_layers)]
        return apportion(weights, total, [stats.m] * n_layers)


class VLCache(CompressionPolicy):
    name = "vlcache"

    def layer_budgets(self, stats, ratio):
        n_layers, m = stats.n_layers, stats.m
        densities = [stats.density(layer) for layer in range(n_layers)]
        total_density = sum(densities) or 1.0
        betas = [min(1.0, max(stats.options.min_layer_ratio, d / total_density * ratio * n_layers)) for d in densities]
        return apportion(betas, keep_budget(ratio, m, n_layers), [m] * n_layers)

    def select(self, stats, layer, k):
        return top_slots(stats.post_vision_mass(layer), k, stats.post_vision)


class VLCacheAll(VLCache):
    """Beyond the paper: VL-Cache's densities and scores with P every text token from the first image
    on (the text between images as well as the trailing segment); the rows always kept stay the
    tokens after the last image, the trailing run of P."""

    name = "vlcache_all"

    def query_rows(self, prompt):
        return prompt.text_after_first_image()

    def select(self, stats, layer, k):
        return top_slots(stats.post_vision_mass(layer), k, trailing_run(stats.post_vision))


class VLCacheFlat(VLCache):
    """Beyond the paper: VL-Cache's token scores (the post-vision rows' attention, P kept) with every
    layer given the same budget. The sparsity rule starves the layers whose post-vision attention is
    most concentrated, and on the quality model those are the layers the answer reads the asked
    cells through (docs/methods.md, "vlcache_flat")."""

    name = "vlcache_flat"
    layer_budgets = CompressionPolicy.layer_budgets


class VLCacheDraft(VLCacheFlat):
    """Beyond the paper: ``vlcache_flat``'s equal budgets, each token scored by its share of the
    post-vision rows' attention plus its share of the attention of ``draft_steps`` decode steps drafted
    greedily on the full cache and then dropped (the answer is decoded again over the kept KV). Only
    the prompt's last two tokens are forced. The post-vision rows see the prompt, not the answer:
    what the answer's steps read to decide where it stops is among what the drafted steps attend to.
    And forcing every post-vision row leaves a short prompt's budget no room for the cells
    (docs/methods.md, "vlcache_draft"); the rows still compete by their score. Costs ``draft_steps``
    decode steps over the uncompressed cache, before compaction."""

    name = "vlcache_draft"
    forced_tail = 2  # the turn template's end, which every decode step reads

    def select(self, stats, layer, k):
        post_vision, drafted = stats.post_vision_mass(layer), stats.draft_mass(layer)
        score = post_vision / post_vision.sum().clamp_min(1e-30) + drafted / drafted.sum().clamp_min(1e-30)
        return top_slots(score, k, stats.post_vision[-self.forced_tail:])


def trailing_run(positions: list[int]) -> list[int]:
    """The last run of consecutive positions of a sorted list (the tokens after the last image, when
    ``positions`` are the text tokens from the first image on)."""
    start = len(positions)
    while start > 0 and (start == len(positions) or positions[start - 1] == positions[start] - 1):
        start -= 1
    return positions[start:]


POLICIES: dict[str, CompressionPolicy] = {p.name: p for p in (KeepAll(), RandomKeep(), StreamingLLM(), H2O(), SnapKV(),
                                                               PyramidKV(), VLCache(), VLCacheAll(), VLCacheFlat(),
                                                               VLCacheDraft())}


def get_policy(name: str) -> CompressionPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise RequestError(f"unknown compression policy {name!r}; use one of {sorted(POLICIES)}") from None


class QueryRecorder:
    """A LayerCapture keeping each layer's q of the decode steps it observes (copied: a step's buffers
    are reused)."""

    def __init__(self) -> None:
        self.q: dict[int, list[torch.Tensor]] = {}

    def on_layer(self, layer: int, q: torch.Tensor, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        self.q.setdefault(layer, []).append(q.clone())

    def on_attention(self, layer: int, lse: torch.Tensor) -> None:
        """Not needed: the statistics over the recorded q find their own normaliser."""

    def stacked(self, layer: int) -> torch.Tensor:
        """The layer's recorded q, [n_steps, n_heads, head_dim] (model dtype)."""
        return torch.cat(self.q[layer]).contiguous()


def decode_mass(seq, layer: int, q: torch.Tensor, positions: list[int], scale: float,
                parallel: TensorParallelGroup | None, threshold: float = 0.01) -> torch.Tensor:
    """float32 [n_tokens(layer)] on q's device: the attention decode-step queries q ([n, n_heads,
    head_dim], at causal ``positions``) give each slot of the layer, summed over steps and heads (and,
    under tensor parallelism, over every rank's heads)."""
    q_pos = torch.tensor(positions, dtype=torch.int32, device=q.device)
    mass, _, _ = seq.attention_stats(layer, q, q_pos, scale, threshold)
    return mass if parallel is None else parallel.all_reduce(mass)


class Recompressor(QueryRecorder):
    """Beyond the paper: every ``every`` decoded tokens, brings each layer back to its budget, keeping
    the post-vision tokens and the recent decoded ones, ranking the rest by the attention of the
    recent decoded tokens. It is the decode steps' LayerCapture (it keeps their q)."""

    def __init__(self, seq, budgets: list[int], every: int, post_vision: list[int], scale: float,
                 parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.seq, self.budgets, self.every, self.post_vision, self.scale = seq, budgets, every, post_vision, scale
        self.parallel = parallel  # tensor parallel: the mass adds up every rank's heads
        self.recent: list[int] = []

    def after_step(self, position: int) -> None:
        self.recent.append(position)
        if len(self.recent) < self.every:
            return
        for layer, budget in enumerate(self.budgets):
            mass = decode_mass(self.seq, layer, self.stacked(layer), self.recent, self.scale, self.parallel)
            positions = self.seq.positions(layer).tolist()
            forced_positions = set(self.recent) | set(self.post_vision)
            forced = [slot for slot, p in enumerate(positions) if p in forced_positions]
            self.seq.compact(layer, top_slots(mass.cpu(), max(budget, len(forced)), forced))
        self.q.clear()
        self.recent = []


def compress_prompt(policy: CompressionPolicy, keep: float, options: CompressOptions, seq, config, queries,
                    post_vision: list[int], stats: GenerationStats, trace: bool = False,
                    parallel: TensorParallelGroup | None = None,
                    draft: DraftQueries | None = None) -> Recompressor | None:
    """Keeps ``keep`` of the prefilled prompt's KV per layer as ``policy`` chooses (compaction gives
    the rest back to the arena) and records the sizes in ``stats`` (with ``trace``, also the prompt
    positions each layer kept: ``stats.kept_positions``; a re-compressor's later choices are not in
    it). ``queries(layer, positions)`` gives the q the prefill computed (see ``PromptStats``). Returns
    the decode steps' re-compressor when ``options.recompress_every`` asks for one. ``parallel``: the
    group of a tensor-parallel model, whose ranks add up their heads' statistics (every rank then
    keeps the same slots). ``draft``: drafts decode steps for the policies that score with them."""
    prompt = PromptStats(seq, config.n_layers, config.n_heads, config.attention_scale, queries, post_vision, options,
                         parallel, draft)
    stats.kv_bytes_before_compress = seq.nbytes
    kept = policy.keep(prompt, keep)
    if trace:  # slot -> position before compaction (every layer holds the prompt in the same slots)
        positions = seq.positions(0).long()
        stats.kept_positions = [sorted(positions[slots].tolist()) for slots in kept]
    for layer, slots in enumerate(kept):
        seq.compact(layer, slots)
    stats.kv_bytes_after_compress = seq.nbytes
    stats.kept_tokens_per_layer = [len(slots) for slots in kept]
    every = options.recompress_every
    return (Recompressor(seq, stats.kept_tokens_per_layer, every, post_vision, config.attention_scale, parallel)
            if every else None)
