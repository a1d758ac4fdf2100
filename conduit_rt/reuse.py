"""The prefill of a request whose images may be cached: CONDUIT (docs/methods.md §1, steps 3-8).

``ReusePass.run`` takes a sequence that already holds an exact prefix (``reused`` tokens) and:
  1. appends the rest of the prompt and restores every cached image into its slots, K rotated at the
     image's new RoPE positions (the entry holds K before RoPE);
  2. text pass: every token that was not restored (text, and images that missed) through all layers,
     attending to the mixed KV; the query rows' q is captured (and, for images to store, K and V);
  3. hands the refresh policy a ``RefreshContext`` (``refresh.base``): the restored visual tokens,
     the budget ceil(r * N_vis), lazy scores and the calls that recompute tokens; the policy
     returns the last prompt token's logits.
Scores: per chosen layer the attention mass the query rows put on each restored token, times value
norms: one native call over every chosen layer (``Sequence.attention_mass``, no [n_q, n] matrix),
normalised by the log-sum-exp the text pass's attention returned for those rows (the keys have not
changed since). A recompute forwards the selected visual tokens (from their cached embeddings) and
every non-restored token after the first selected one, causal by position over the mixed KV,
overwriting their KV. With no image restored, step 2 is an ordinary prefill. Text between restored
images is recomputed along with the tail (beyond docs/methods.md §1 step 8, which names only the
trailing segment), so that r = 1 reproduces a cold full prefill exactly.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .arena import Sequence
from .capture import PassCapture
from .chat import ImageSlot
from .image_cache import CachedImage
from .models.base import ForwardBatch, VisionLanguageModel
from .parallel.group import model_group
from .refresh import LayerObserver, RefreshOptions, RefreshPolicy, VisualTokens
from .results import GenerationStats
from .selection import budget_tokens

CHUNK = 2048
# Most positions whose input embeddings are gathered while the scoring runs (``start_scoring``): at
# LLaVA-7B's hidden size 64 MiB of bf16; a longer prompt gathers its recompute rows after the selection.
MAX_CANDIDATES = 8192


@dataclass(slots=True)
class ReuseStats:
    """What the prefill reused and recomputed (FLOPs are per the model's linear + attention work)."""

    visual_tokens: int = 0             # restored visual tokens (N_vis)
    refreshed_tokens: int = 0          # of those, recomputed
    recomputed_token_layers: int = 0   # token-layers of the recompute pass
    prefill_flops: float = 0.0
    full_prefill_flops: float = 0.0
    restored_positions: list[int] | None = None          # the selection trace (``ReusePass.run``'s ``trace``)
    refreshed_positions: list[list[int]] | None = None

    def report(self, stats: GenerationStats) -> None:
        """Writes what the request's statistics show of it."""
        stats.visual_tokens, stats.refreshed_tokens = self.visual_tokens, self.refreshed_tokens
        stats.restored_positions, stats.refreshed_positions = self.restored_positions, self.refreshed_positions
        stats.recomputed_token_layers = self.recomputed_token_layers
        stats.prefill_flops_ratio = self.prefill_flops / self.full_prefill_flops if self.full_prefill_flops else 0.0


@dataclass(frozen=True, slots=True)
class RestoredImage:
    """A cached image shown at ``slot`` of the prompt."""

    slot: ImageSlot
    cached: CachedImage


@dataclass(slots=True)
class ReusePass:
    """One request's prefill (see the module docstring). ``embed(positions)`` gives the input
    embeddings [n, hidden] of prompt positions (image positions from the cached image features)."""

    model: VisionLanguageModel
    seq: Sequence
    rope: torch.Tensor                         # int32 [n] or [3, n], CPU: the prompt's RoPE positions
    n_prompt: int
    reused: int
    restored: list[RestoredImage]
    embed: Callable[[list[int]], torch.Tensor]
    query_positions: list[int]
    store: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> prompt positions to store
    observe: list[int] = field(default_factory=list)  # further positions whose final q is kept (compression)
    stats: ReuseStats = field(default_factory=ReuseStats)
    # runs a pass (model.forward's contract); PrefillGraphs.forward replays small passes' dense work
    forward: Callable | None = None

    def run(self, policy: RefreshPolicy | None, ratio: float, options: RefreshOptions,
            trace: bool = False) -> tuple[torch.Tensor, PassCapture]:
        """Returns the last prompt token's logits [vocab] and the passes' capture. ``trace``: ``stats``
        keeps the restored visual tokens' positions and, with a policy, those it recomputed per layer."""
        config = self.model.config
        self.seq.append(torch.arange(self.reused, self.n_prompt, dtype=torch.int32))
        visual = self._restore()
        text_positions = [p for p in range(self.reused, self.n_prompt) if not visual[p]]
        capture = PassCapture(set(self.query_positions) | set(self.observe), self.store)
        hidden = self._forward(text_positions, capture)
        self.stats.prefill_flops += config.n_layers * _flops(config, text_positions)
        self.stats.full_prefill_flops = config.n_layers * _flops(config, list(range(self.n_prompt)))
        tokens = self._visual_tokens()
        self.stats.visual_tokens = tokens.n
        if trace:
            self.stats.restored_positions = tokens.slots.tolist()
        if tokens.n == 0 or policy is None:
            if trace and policy is not None:
                self.stats.refreshed_positions = [[] for _ in range(config.n_layers)]
            return self.model.logits(hidden[-1:])[0], capture
        context = _Context(self, capture, tokens, budget_tokens(ratio, tokens.n), options, hidden, text_positions)
        refreshed = policy.refresh(context)
        context.charge_scores()
        self.stats.refreshed_tokens = refreshed.refreshed_tokens
        if trace:
            self.stats.refreshed_positions = context.refreshed_positions()
        return refreshed.logits, capture

    def _pass(self, seq, embeds: torch.Tensor, batch: ForwardBatch, capture) -> torch.Tensor:
        return (self.forward or self.model.forward)(seq, embeds, batch, capture)

    def _restore(self) -> list[bool]:
        """Restores every cached image at its slots, all layers in one native call (one kernel launch);
        returns a restored-mask per position."""
        visual = [False] * self.n_prompt
        if not self.restored:
            return visual
        # numpy for the host index work: indexing a CPU tensor with torch costs far more per call
        slots = np.concatenate([np.arange(r.slot.start, r.slot.start + r.slot.n_tokens, dtype=np.int32)
                                for r in self.restored])
        rope = torch.from_numpy(np.ascontiguousarray(self.rope.numpy()[..., slots]))
        rope = rope.to(self.model.device, non_blocking=True)  # one upload, all images
        self.seq.restore_images([r.cached.entry for r in self.restored], slots=slots, rope_pos=rope)
        for r in self.restored:
            visual[r.slot.start:r.slot.start + r.slot.n_tokens] = [True] * r.slot.n_tokens
        return visual

    def _forward(self, positions: list[int], capture: PassCapture) -> torch.Tensor:
        """Forwards prompt positions in chunks, KV into their slots; returns the last chunk's hidden."""
        hidden = None
        for lo in range(0, len(positions), CHUNK):
            chunk = positions[lo: lo + CHUNK]
            capture.begin_chunk(chunk)
            hidden = self._pass(self.seq, self.embed(chunk), self._batch(chunk), capture)
        return hidden

    def _batch(self, positions: list[int]) -> ForwardBatch:
        device = self.model.device
        slots = np.asarray(positions, dtype=np.int32)  # once: every layer's KV write reads it
        rope = torch.from_numpy(np.ascontiguousarray(self.rope.numpy()[..., slots]))  # numpy: see _restore
        # non_blocking: a blocking copy from the host waits for every kernel queued before it
        return ForwardBatch(positions=torch.from_numpy(slots).to(device, non_blocking=True),
                            rope_positions=rope.to(device, non_blocking=True), slots=slots)

    def _visual_tokens(self) -> VisualTokens:
        slots, image = [], []
        for j, restored in enumerate(self.restored):
            slots.append(torch.arange(restored.slot.start, restored.slot.start + restored.slot.n_tokens))
            image.append(torch.full((restored.slot.n_tokens,), j))
        if not slots:
            empty = torch.zeros(0, dtype=torch.long)
            return VisualTokens(empty, empty, 0)
        return VisualTokens(torch.cat(slots), torch.cat(image), len(self.restored))


class _Context:
    """The ``RefreshContext`` (refresh.base) of one ReusePass after its text pass."""

    def __init__(self, run: ReusePass, capture: PassCapture, tokens: VisualTokens, budget: int,
                 options: RefreshOptions, hidden: torch.Tensor, text_positions: list[int]) -> None:
        self.run, self.capture, self.tokens, self.budget, self.options = run, capture, tokens, budget, options
        self.seq, self.config = run.seq, run.model.config
        self.scores = _PassScores(run, capture, tokens, options.layers)
        self._hidden = hidden  # the text pass's last chunk
        self._text = np.asarray(text_positions, dtype=np.int64)
        self._candidates: tuple[np.ndarray, torch.Tensor] | None = None
        self._scores_charged = False
        # the rows recomputed, kept by reference (no copy): of a one-pass recompute (every layer), and
        # of a layer-wise one (per layer); read by ``refreshed_positions`` only
        self._recomputed: np.ndarray | None = None
        self._layer_rows: dict[int, list[int]] = {}

    def start_scoring(self) -> None:
        if self.budget > 0:  # the host prepares the recompute's inputs while the scoring runs
            self.scores.attention()
            self._candidates = self._gather_candidates()

    def charge_scores(self) -> None:
        """Adds the scoring's FLOPs to the prefill's, once, if the scores were computed."""
        if self.scores.used and not self._scores_charged:
            self.run.stats.prefill_flops += self.scores.flops
            self._scores_charged = True

    def queries(self, layer: int) -> tuple[torch.Tensor, list[int]]:
        return self.capture.queries(layer, self.run.query_positions)

    def text_pass_logits(self) -> torch.Tensor:
        return self.last_logits(self._hidden)

    def recompute_rows(self, slots: np.ndarray) -> np.ndarray:
        return np.union1d(slots, self._text[self._text > slots.min()])

    def recompute(self, selected: torch.Tensor) -> torch.Tensor:
        self.charge_scores()
        if selected.numel() == 0:
            return self.text_pass_logits()
        # The device idles from the selection's host sync to the recompute's first launch: only what
        # the launch needs runs in between (numpy, not Python sets), the bookkeeping after it.
        rows = self.recompute_rows(self.tokens.slots[selected].numpy())
        self._recomputed = rows
        if self._candidates is not None:
            positions, embeds = self._candidates
            embeds = embeds[torch.from_numpy(np.searchsorted(positions, rows)).to(embeds.device, non_blocking=True)]
        else:
            embeds = self.run.embed(rows.tolist())
        rows = rows.tolist()
        self.capture.store = {}  # images to store keep the KV of the text pass: the request first computed them there
        self.capture.begin_chunk(rows)
        out = self.run._pass(self.seq, embeds, self.run._batch(rows), self.capture)
        self.run.stats.recomputed_token_layers += len(rows) * self.config.n_layers
        self.run.stats.prefill_flops += self.config.n_layers * _flops(self.config, rows)
        return self.last_logits(out)

    def rescore(self) -> _PassScores:
        """Scores over the KV as it is now, from the query rows' q and lse of the latest pass that
        computed them; their FLOPs are charged now."""
        scores = _PassScores(self.run, self.capture, self.tokens, self.options.layers)
        scores.attention()
        self.run.stats.prefill_flops += scores.flops
        return scores

    def head_attention(self) -> torch.Tensor:
        """a_{l,h}(t): each query head's attention over the restored visual tokens, averaged over the
        query rows, for every chosen layer: float32 [n_layers_chosen, n_heads, N]. Each row's softmax
        runs over every key the row sees (by causal position), in torch from the sequence's KV, as the
        text pass left it; charged now as the native scoring is (2 H d FLOPs per visible pair)."""
        config, seq = self.config, self.seq
        layers = self.scores.layers
        slots = self.tokens.slots.to(self.run.model.device)
        key_positions = seq.positions(0).to(self.run.model.device).long()
        per_layer = []
        for layer in layers:
            q, q_positions = self.queries(layer)                                  # [n_q, H, d]
            if not q_positions:
                per_layer.append(torch.zeros(config.n_heads, self.tokens.n, device=slots.device))
                continue
            k, _ = seq.read_kv(layer)                                             # [n, KVH, d]
            keys = k.float().repeat_interleave(config.n_heads // config.n_kv_heads, dim=1)
            logits = torch.einsum("qhd,khd->hqk", q.float(), keys) * config.attention_scale
            rows = torch.tensor(q_positions, device=logits.device)
            logits = logits.masked_fill(key_positions[None, None, :] > rows[None, :, None], float("-inf"))
            per_layer.append(logits.softmax(dim=-1).mean(dim=1)[:, slots])       # [H, N]
        self.run.stats.prefill_flops += len(layers) * sum(2.0 * config.n_heads * config.head_dim * (p + 1)
                                                          for p in self.run.query_positions)
        parallel = model_group(self.run.model)
        # tensor parallel: each rank has its own heads; gathered in rank order, they are every head in order
        return torch.stack(per_layer) if parallel is None else parallel.gather(torch.stack(per_layer), dim=1)

    def first_layer_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every restored visual token through layer 0 (its layer-0 KV, a function of its embedding
        alone, written again), then layer 1's pre-RoPE K and V of the output, not written:
        [N, n_kv_heads, head_dim] each. Charged as N token-layers plus the K and V projection FLOPs."""
        rows = self.tokens.slots.tolist()
        x = self.run.model.forward_layer(0, self.seq, self.run.embed(rows), self.run._batch(rows))
        c = self.config
        self.run.stats.recomputed_token_layers += len(rows)
        self.run.stats.prefill_flops += _flops(c, rows) + 2.0 * len(rows) * c.hidden * 2 * c.n_kv_heads * c.head_dim
        return self.run.model.kv_projection(1, x)

    def embed(self, positions: list[int]) -> torch.Tensor:
        return self.run.embed(positions)

    def refreshed_positions(self) -> list[list[int]]:
        """Per decoder layer, the positions of the restored visual tokens recomputed there (sorted)."""
        slots = self.tokens.slots.numpy()
        every_layer = np.intersect1d(self._recomputed, slots) if self._recomputed is not None else slots[:0]
        return [np.union1d(every_layer, np.intersect1d(self._layer_rows.get(layer, []), slots)).tolist()
                for layer in range(self.config.n_layers)]

    def forward_layer(self, layer: int, rows: list[int], x: torch.Tensor, observer: LayerObserver) -> torch.Tensor:
        self._layer_rows[layer] = rows
        self.capture.store = {}
        self.capture.begin_chunk(rows)
        x = self.run.model.forward_layer(layer, self.seq, x, self.run._batch(rows), _Tee(self.capture, observer))
        self.run.stats.recomputed_token_layers += len(rows)
        self.run.stats.prefill_flops += _flops(self.config, rows)
        return x

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        reads = [r.cached.entry.read(layer) for r in self.run.restored]
        return torch.cat([k for k, _ in reads]), torch.cat([v for _, v in reads])

    def last_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.run.model.logits(hidden[-1:])[0]

    def _gather_candidates(self) -> tuple[np.ndarray, torch.Tensor] | None:
        """Every position a recompute may take (the restored visual tokens and the text after the
        first of them; sorted) and their input embeddings, queued behind the scoring: the host builds
        them while the device scores, so that after the selection's host sync one gather is left
        before the recompute's first launch. None past MAX_CANDIDATES positions: the recompute's
        rows are embedded after the selection instead."""
        positions = self.recompute_rows(self.tokens.slots.numpy())
        if positions.size > MAX_CANDIDATES:
            return None
        return positions, self.run.embed(positions.tolist())


class _Tee:
    """The capture of a layer-wise recompute: the pass's own capture, then the policy's observer."""

    def __init__(self, capture: PassCapture, observer: LayerObserver) -> None:
        self.capture, self.observer = capture, observer

    def on_layer(self, layer: int, q: torch.Tensor, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        self.capture.on_layer(layer, q, k_pre_rope, v)
        self.observer.on_layer(layer, q, k_pre_rope, v)

    def on_attention(self, layer: int, lse: torch.Tensor) -> None:
        self.capture.on_attention(layer, lse)


class _PassScores:
    """The score sources of docs/methods.md §1 step 5, computed once on first use."""

    def __init__(self, run: ReusePass, capture: PassCapture, tokens: VisualTokens,
                 layers: tuple[int, ...] | None) -> None:
        self.run, self.capture, self.tokens = run, capture, tokens
        self.layers = sorted(set(layers)) if layers is not None else list(range(run.model.config.n_layers))
        self._attention: torch.Tensor | None = None
        self.used, self.flops = False, 0.0

    def attention(self) -> torch.Tensor:
        """a_l(t) = mass over the query rows and heads / (|Q| * H): float32 [n_layers_chosen, N]."""
        if self._attention is None:
            config, seq = self.run.model.config, self.run.seq
            device = self.run.model.device
            slots = self.tokens.slots.to(device, non_blocking=True)
            # One native call for every layer (the layers hold as many slots: the text pass wrote them
            # all), normalised by the text pass's own log-sum-exp of each row: no score pass, no host
            # sync, no per-layer launch from Python.
            q, lse, found = self.capture.scoring_rows(self.layers, self.run.query_positions)
            if not found:
                self._attention = torch.zeros(len(self.layers), self.tokens.n, device=device)
            else:
                q_pos = torch.tensor(found, dtype=torch.int32).to(device, non_blocking=True)
                masses = seq.attention_mass(self.layers, q, q_pos, lse, config.attention_scale)
                n_heads, parallel = config.n_heads, model_group(self.run.model)
                if parallel is not None:  # each rank summed its own heads: add up every rank's
                    masses, n_heads = parallel.all_reduce(masses), n_heads * parallel.size
                self._attention = masses[:, slots] / (len(found) * n_heads)
            self.used = True
            self.flops = len(self.layers) * sum(2.0 * config.n_heads * config.head_dim * (p + 1)
                                                for p in self.run.query_positions)
        return self._attention

    def value_norms(self) -> torch.Tensor:
        """||V_l(t)|| over all KV heads, from the cached entries: float32 [n_layers_chosen, N]."""
        norms = torch.cat([r.cached.value_norms for r in self.run.restored], dim=1)  # [L, N]
        parallel = model_group(self.run.model)
        if parallel is not None:  # each rank's entries hold its own KV heads: the norm over all of them
            norms = parallel.all_reduce(norms.square()).sqrt()
        if self.layers != list(range(norms.shape[0])):
            # a device index: a Python list would go up in a blocking copy, which waits for the scoring
            norms = norms[torch.tensor(self.layers).to(norms.device, non_blocking=True)]
        return norms.to(self.run.model.device, non_blocking=True)


def _flops(config, positions: list[int]) -> float:
    """Linear + attention FLOPs of one layer for tokens at these causal positions (keys ≈ position + 1)."""
    if not positions:
        return 0.0
    c = config
    linear = 2.0 * (c.hidden * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.hidden
                    + 3 * c.hidden * c.intermediate)
    visible = float(sum(positions)) + len(positions)
    return linear * len(positions) + 4.0 * c.n_heads * c.head_dim * visible
