"""The prefill of a request whose images may be cached: CONDUIT (METHODS.md §1, steps 3-8).

``ReusePass.run`` takes a sequence that already holds an exact prefix (``reused`` tokens) and:
  1. appends the rest of the prompt and restores every cached image into its slots, K rotated at the
     image's new RoPE positions (the entry holds K before RoPE);
  2. text pass: every token that was not restored (text, and images that missed) through all layers,
     attending to the mixed KV; the query rows' q is captured (and, for images to store, K and V);
  3. scores (only for policies that use them): per chosen layer the attention mass the query rows
     put on each restored token, times value norms: one native call over every chosen layer
     (``Sequence.attention_mass``, no [n_q, n] matrix), normalised by the log-sum-exp the text pass's
     attention returned for those rows (the keys have not changed since);
  4. selection by the refresh policy under the budget ceil(r * N_vis);
  5. recompute: the selected visual tokens (from their cached embeddings) and every non-restored
     token after the first selected one, causal by position over the mixed KV, overwriting their
     KV. With nothing selected, the text pass's logits stand (a recompute would reproduce them).
With no image restored, step 2 is an ordinary prefill. Text between restored images is recomputed
along with the tail (an extension of METHODS.md, which names only the trailing segment), so that
r = 1 reproduces a cold full prefill exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .chat import ImageSlot
from .image_cache import CachedImage
from .models.base import ForwardBatch
from .refresh import CacheBlend, RefreshOptions, RefreshPolicy, VisualTokens, budget_tokens, top_k_indices

CHUNK = 2048
# Most positions whose input embeddings are gathered while the scoring runs (see ReusePass._candidates):
# at LLaVA-7B's hidden size 64 MiB of bf16; a longer prompt gathers its recompute rows after the selection.
MAX_CANDIDATES = 8192


@dataclass(slots=True)
class ReuseStats:
    """What the prefill reused and recomputed (FLOPs are per the model's linear + attention work)."""

    image_hits: int = 0
    image_misses: int = 0
    visual_tokens: int = 0             # restored visual tokens (N_vis)
    refreshed_tokens: int = 0          # of those, recomputed
    recomputed_token_layers: int = 0   # token-layers of the recompute pass
    prefill_flops: float = 0.0
    full_prefill_flops: float = 0.0


@dataclass(frozen=True, slots=True)
class RestoredImage:
    """A cached image shown at ``slot`` of the prompt."""

    slot: ImageSlot
    cached: CachedImage


class PassCapture:
    """LayerCapture of a request's passes: q and the attention's log-sum-exp of the observed positions
    per layer (the latest pass that computed a position wins), and pre-RoPE K and V of the image
    tokens to store.

    Per layer, each pass's observed q rows stay one tensor ([n_observed, n_heads, head_dim]) beside
    the pass's position -> row map, which is built once per chunk and shared by its layers: a layer
    costs one gather (a copy when the rows are consecutive, as a text pass's trailing question is),
    no per-position work and no host sync (the row index is uploaded once per chunk, without
    blocking). Their lse rows ([n_observed, n_heads] float32) are a view of the attention's own
    output when consecutive (no launch), else one gather.
    """

    def __init__(self, observe: set[int], store: dict[bytes, tuple[int, int]]) -> None:
        self.observe, self.store = observe, store
        self.q: dict[int, list[tuple[dict[int, int], torch.Tensor]]] = {}  # layer -> [(position -> row, q rows)]
        self.lse: dict[int, list[torch.Tensor]] = {}  # layer -> lse rows, one per entry of self.q[layer]
        self._kv: dict[bytes, dict[int, tuple[list, list]]] = {key: {} for key in store}
        self._positions: list[int] = []
        self._observed: dict[int, int] = {}  # position -> row among the chunk's observed rows
        self._rows = _DeviceIndex([])        # the chunk's observed rows, in order
        self._plans: dict[tuple, tuple[list[int], object, tuple]] = {}  # see _query_plan

    def begin_chunk(self, positions: list[int]) -> None:
        """The next forward computes these prompt positions, one per row."""
        self._positions = positions
        self._rows = _DeviceIndex([i for i, p in enumerate(positions) if p in self.observe])
        self._observed = {positions[i]: j for j, i in enumerate(self._rows.rows)}

    def on_layer(self, layer: int, q: torch.Tensor, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        if self._rows.rows:
            # copied: q may be a buffer the next layer overwrites
            self.q.setdefault(layer, []).append((self._observed, self._observed_rows(q, copy=True)))
        lo, hi = self._positions[0], self._positions[-1] + 1
        for key, (a, b) in self.store.items():
            rows = [i for i, p in enumerate(self._positions) if a <= p < b] if a < hi and b > lo else []
            if rows:
                idx = torch.tensor(rows).to(k_pre_rope.device, non_blocking=True)
                ks, vs = self._kv[key].setdefault(layer, ([], []))
                ks.append(k_pre_rope[idx].clone())
                vs.append(v[idx].clone())

    def on_attention(self, layer: int, lse: torch.Tensor) -> None:
        if self._rows.rows:
            self.lse.setdefault(layer, []).append(self._observed_rows(lse, copy=False))

    def _observed_rows(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        """The chunk's observed rows of t: a slice (copied if ``copy``) when consecutive, else a gather."""
        rows = self._rows.rows
        if rows[-1] - rows[0] + 1 == len(rows):
            view = t[rows[0]: rows[0] + len(rows)]
            return view.clone() if copy else view
        return t[self._rows.on(t.device)]

    def queries(self, layer: int, positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """q at ``layer`` of those ``positions`` that were computed: ([n, n_heads, head_dim], positions)."""
        q, found = self._rows_of(self.q.get(layer, []), positions)
        return (q.contiguous(), found) if found else (torch.zeros(0), [])

    def scoring_rows(self, layers: list[int], positions: list[int]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[int]]:
        """q and the attention's lse of those ``positions`` that were computed, every layer of ``layers``
        stacked: ([n_layers, n, n_heads, head_dim], float32 [n_layers, n, n_heads], positions); the
        positions must be the same in every layer (a pass computes all of them). Tensors are None when
        none was computed."""
        qs, lses, found = [], [], None
        for layer in layers:
            passes = self.q.get(layer, [])
            lses_of_layer = self.lse.get(layer, [])
            if len(lses_of_layer) != len(passes):
                raise RuntimeError(f"layer {layer}: a pass kept q without its attention's lse")
            q, layer_found = self._rows_of(passes, positions)
            lse, _ = self._rows_of([(rows, lse) for (rows, _), lse in zip(passes, lses_of_layer)], positions)
            if found is not None and layer_found != found:
                raise RuntimeError(f"layer {layer} computed other query positions than layer {layers[0]}")
            found = layer_found
            qs.append(q)
            lses.append(lse)
        if not found:
            return None, None, []
        return torch.stack(qs), torch.stack(lses), found

    def _rows_of(self, passes: list[tuple[dict[int, int], torch.Tensor]], positions: list[int]
                 ) -> tuple[torch.Tensor | None, list[int]]:
        """The rows of the passes' tensors holding those ``positions`` that were computed (the latest
        pass wins), in the order of ``positions``: (tensor or None, the positions found)."""
        found, gather = self._query_plan(tuple(rows for rows, _ in passes), positions)
        found = list(found)  # the plan's own is shared by every layer
        if not found:
            return None, []
        if isinstance(gather, int):  # one pass computed them all, as its rows in order
            return passes[gather][1], found
        if isinstance(gather, tuple):  # one pass, some of its rows: one gather
            index, rows = gather
            tensor = passes[index][1]
            return tensor[rows.on(tensor.device)], found
        return torch.stack([passes[index][1][row] for index, row in gather]), found

    def _query_plan(self, maps: tuple[dict[int, int], ...], positions: list[int]) -> tuple[list[int], object]:
        """Which of ``positions`` the passes computed and where their q rows lie, worked out once per
        distinct list of position -> row maps (every layer of a pass shares its chunk's map, so the
        32 layers of a scoring loop share one plan). The plan: a pass index (all its rows, in order),
        (pass index, its rows as a ``_DeviceIndex``) or [(pass index, row), ...] across passes."""
        key = (tuple(id(m) for m in maps), tuple(positions))
        plan = self._plans.get(key)
        if plan is not None and all(a is b for a, b in zip(plan[2], maps)):  # the same maps, not reused ids
            return plan[0], plan[1]
        sources = {}  # position -> (pass, row), the latest pass that computed it
        for index, rows in enumerate(maps):
            sources.update((p, (index, row)) for p, row in rows.items())
        found = [p for p in positions if p in sources]
        taken = [sources[p] for p in found]
        gather: object = taken
        if taken and all(index == taken[0][0] for index, _ in taken):
            index, rows = taken[0][0], [row for _, row in taken]
            gather = index if rows == list(range(len(maps[index]))) else (index, _DeviceIndex(rows))
        self._plans[key] = (found, gather, maps)
        return found, gather

    def stored(self, key: bytes, n_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer pre-RoPE K and V [n_tokens, n_kv_heads, head_dim] of an image to store."""
        ks = [torch.cat(self._kv[key][layer][0]) for layer in range(n_layers)]
        vs = [torch.cat(self._kv[key][layer][1]) for layer in range(n_layers)]
        return ks, vs


class _DeviceIndex:
    """Row indices (a list, host) with their int64 tensor uploaded once per device, non-blocking (a
    blocking upload waits for every queued kernel)."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = torch.tensor(self.rows).to(device, non_blocking=True)
        return self._on[device]


@dataclass(slots=True)
class ReusePass:
    """One request's prefill (see the module docstring). ``embed(positions)`` gives the input
    embeddings [n, hidden] of prompt positions (image positions from the cached image features)."""

    model: object
    seq: object
    rope: torch.Tensor                         # int32 [n] or [3, n], CPU: the prompt's RoPE positions
    n_prompt: int
    reused: int
    restored: list[RestoredImage]
    embed: object
    query_positions: list[int]
    store: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> prompt positions to store
    observe: list[int] = field(default_factory=list)  # further positions whose final q is kept (compression)
    stats: ReuseStats = field(default_factory=ReuseStats)
    # runs a pass (model.forward's contract); PrefillGraphs.forward replays small passes' dense work
    forward: object = None

    def run(self, policy: RefreshPolicy | None, ratio: float, options: RefreshOptions) -> tuple[torch.Tensor, PassCapture]:
        """Returns the last prompt token's logits [vocab] and the text pass's capture."""
        config = self.model.config
        self.seq.append(torch.arange(self.reused, self.n_prompt, dtype=torch.int32))
        visual = self._restore()
        text_positions = [p for p in range(self.reused, self.n_prompt) if not visual[p]]
        layers = set(options.layers) if options.layers is not None else None
        capture = PassCapture(set(self.query_positions) | set(self.observe), self.store)
        hidden = self._forward(text_positions, capture)
        self.stats.prefill_flops += config.n_layers * _flops(config, text_positions)
        self.stats.full_prefill_flops = config.n_layers * _flops(config, list(range(self.n_prompt)))
        tokens = self._visual_tokens()
        self.stats.visual_tokens = tokens.n
        if tokens.n == 0 or policy is None:
            return self.model.logits(hidden[-1:])[0], capture
        budget = budget_tokens(ratio, tokens.n)
        if policy.layerwise and budget == 0:
            return self.model.logits(hidden[-1:])[0], capture
        if policy.layerwise:
            return self._recompute_layerwise(tokens, budget, text_positions, capture), capture
        scores = _PassScores(self, capture, tokens, layers)
        text = np.asarray(text_positions, dtype=np.int64)
        candidates = None
        if policy.uses_scores and budget > 0:  # the host prepares the recompute's inputs while the scoring runs
            scores.attention()
            candidates = self._candidates(tokens, text)
        selected = policy.select(tokens, budget, scores, options)
        if scores.used:
            self.stats.prefill_flops += scores.flops
        self.stats.refreshed_tokens = int(selected.numel())
        if selected.numel() == 0:
            return self.model.logits(hidden[-1:])[0], capture
        # The device idles from the selection's host sync to the recompute's first launch: only what
        # the launch needs runs in between (numpy, not Python sets), the bookkeeping after it.
        picked = tokens.slots[selected].numpy()
        rows = np.union1d(picked, text[text > picked.min()])
        if candidates is not None:
            positions, embeds = candidates
            embeds = embeds[torch.from_numpy(np.searchsorted(positions, rows)).to(embeds.device, non_blocking=True)]
        else:
            embeds = self.embed(rows.tolist())
        rows = rows.tolist()
        capture.store = {}  # images to store keep the KV of the text pass: the request first computed them there
        capture.begin_chunk(rows)
        out = self._pass(self.seq, embeds, self._batch(rows), capture)
        self.stats.recomputed_token_layers = len(rows) * config.n_layers
        self.stats.prefill_flops += config.n_layers * _flops(config, rows)
        return self.model.logits(out[-1:])[0], capture

    def _pass(self, seq, embeds: torch.Tensor, batch: ForwardBatch, capture: PassCapture) -> torch.Tensor:
        return (self.forward or self.model.forward)(seq, embeds, batch, capture)

    # -- steps ------------------------------------------------------------------------------------
    def _restore(self) -> list[bool]:
        """Restores every cached image at its slots, all layers in one native call (one kernel launch);
        returns a restored-mask per position."""
        visual = [False] * self.n_prompt
        if not self.restored:
            return visual
        # numpy for the host index work: torch's index of the CPU tensor took 1.8 ms of a profiled
        # request on the H200's host (10 us alone; the cause was not found), numpy's takes microseconds
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

    def _candidates(self, tokens: VisualTokens, text: np.ndarray) -> tuple[np.ndarray, torch.Tensor] | None:
        """Every position a recompute may take (the restored visual tokens and the text after the first
        of them; sorted) and their input embeddings, queued behind the scoring (call it after queueing
        the scoring, for a selection that will pick something): the host builds them
        while the device scores, and after the selection's host sync only one gather is left (the
        ~1 ms of host work it replaces sat between the sync and the recompute's first launch, the
        device idle). None past MAX_CANDIDATES positions: the recompute's rows are embedded after
        the selection instead."""
        visual = tokens.slots.numpy()
        positions = np.union1d(visual, text[text > visual.min()])
        if positions.size > MAX_CANDIDATES:
            return None
        return positions, self.embed(positions.tolist())

    def _visual_tokens(self) -> VisualTokens:
        slots, image = [], []
        for j, restored in enumerate(self.restored):
            slots.append(torch.arange(restored.slot.start, restored.slot.start + restored.slot.n_tokens))
            image.append(torch.full((restored.slot.n_tokens,), j))
        if not slots:
            empty = torch.zeros(0, dtype=torch.long)
            return VisualTokens(empty, empty, 0)
        return VisualTokens(torch.cat(slots), torch.cat(image), len(self.restored))

    def _recompute_layerwise(self, tokens: VisualTokens, budget: int, text_positions: list[int],
                             capture: PassCapture) -> torch.Tensor:
        """CacheBlend: every visual token on layers 0-1, then per layer the ones whose fresh K, V moved
        most from the cached ones (||dK|| + ||dV||), counts falling linearly (mean = budget)."""
        config = self.model.config
        counts = CacheBlend.layer_counts(tokens.n, budget, config.n_layers)
        self.stats.refreshed_tokens = budget
        first = int(tokens.slots.min())
        text_rows = [p for p in text_positions if p > first]
        rows = sorted(tokens.slots.tolist() + text_rows)
        visual_of_slot = {int(s): i for i, s in enumerate(tokens.slots.tolist())}
        # row -> index among the visual tokens (-1 for text rows)
        visual_index = torch.tensor([visual_of_slot.get(r, -1) for r in rows], dtype=torch.long)
        x = self.embed(rows)
        capture.store = {}
        for layer in range(config.n_layers):
            capture.begin_chunk(rows)
            delta = _DeltaCapture(visual_index, lambda layer=layer: self._cached_kv(layer), capture)
            x = self.model.forward_layer(layer, self.seq, x, self._batch(rows), delta)
            self.stats.recomputed_token_layers += len(rows)
            self.stats.prefill_flops += _flops(config, rows)
            if layer + 1 < config.n_layers:
                keep = delta.keep(counts[layer + 1])
                x, visual_index = x[keep.to(x.device)], visual_index[keep]
                rows = [rows[i] for i in keep.tolist()]
        return self.model.logits(x[-1:])[0]

    def _cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached pre-RoPE K and V of every restored token at ``layer``: [N, n_kv_heads, head_dim] each."""
        reads = [r.cached.entry.read(layer) for r in self.restored]
        return torch.cat([k for k, _ in reads]), torch.cat([v for _, v in reads])


class _DeltaCapture:
    """One layer of CacheBlend: ||K_fresh - K_cached|| + ||V_fresh - V_cached|| (pre-RoPE) per visual row."""

    def __init__(self, visual_index: torch.Tensor, cached_kv, inner: PassCapture) -> None:
        self.visual_index, self.cached_kv, self.inner = visual_index, cached_kv, inner
        self.change: torch.Tensor | None = None

    def on_attention(self, layer: int, lse: torch.Tensor) -> None:
        self.inner.on_attention(layer, lse)

    def on_layer(self, layer: int, q, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.on_layer(layer, q, k_pre_rope, v)
        is_visual = self.visual_index >= 0
        k_old, v_old = self.cached_kv()
        rows = torch.nonzero(is_visual).flatten().to(k_pre_rope.device)
        idx = self.visual_index[is_visual].to(k_old.device)
        dk = (k_pre_rope[rows].float() - k_old[idx].float()).flatten(1).norm(dim=1)
        dv = (v[rows].float() - v_old[idx].float()).flatten(1).norm(dim=1)
        self.change = torch.full((self.visual_index.numel(),), float("-inf"), device=dk.device)
        self.change[rows] = dk + dv

    def keep(self, n_visual: int) -> torch.Tensor:
        """Row indices (CPU, sorted) for the next layer: every text row and the n_visual most changed."""
        is_visual = self.visual_index >= 0
        visual_rows = torch.nonzero(is_visual).flatten()
        change = self.change.cpu()[visual_rows]
        top = visual_rows[top_k_indices(change, min(n_visual, visual_rows.numel()))]
        return torch.sort(torch.cat([torch.nonzero(~is_visual).flatten(), top])).values


class _PassScores:
    """The score sources of METHODS.md §1 step 5, computed once on first use."""

    def __init__(self, run: ReusePass, capture: PassCapture, tokens: VisualTokens, layers: set[int] | None) -> None:
        self.run, self.capture, self.tokens = run, capture, tokens
        self.layers = sorted(layers) if layers is not None else list(range(run.model.config.n_layers))
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
                self._attention = masses[:, slots] / (len(found) * config.n_heads)
            self.used = True
            self.flops = len(self.layers) * sum(2.0 * config.n_heads * config.head_dim * (p + 1)
                                                for p in self.run.query_positions)
        return self._attention

    def value_norms(self) -> torch.Tensor:
        """||V_l(t)|| over all KV heads, from the cached entries: float32 [n_layers_chosen, N]."""
        norms = torch.cat([r.cached.value_norms for r in self.run.restored], dim=1)  # [L, N]
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
