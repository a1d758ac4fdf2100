"""The plan of a request's prefill: how much of the prompt an exact prefix already holds (a chat
session's sequence, or the prefix cache), which images after it come back from the image-KV store
(docs/methods.md §1 step 3; in the arena, or loaded from the cache folder), which are computed (and
stored as the request computes them), and the isolated fill of a missing image (step 2). The pass
itself is ``reuse.ReusePass``."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .arena import KVArena, Sequence
from .capture import PassCapture
from .chat import ImageSlot
from .image_cache import ImageKVStore
from .prefill_graph import PrefillGraphs
from .prefix_cache import PrefixCache, common_prefix
from .refresh import RefreshOptions, RefreshPolicy
from .request import Request, RequestReader
from .results import GenerationStats
from .reuse import RestoredImage, ReusePass


@dataclass(slots=True)
class HeldSequence:
    """A sequence a chat session keeps in the arena between turns, and the identity of each of its
    tokens (``request.Request.identity`` entries). Empty while a turn runs on it."""

    seq: Sequence | None = None
    identity: list = field(default_factory=list)

    def free(self) -> None:
        if self.seq is not None:
            self.seq.free()
        self.seq, self.identity = None, []


@dataclass(slots=True)
class Plan:
    """A request's sequence holding its exact prefix (``reused`` tokens), the cached images to restore
    after it (held until the plan is released), and the images to store once computed (key ->
    prompt positions). As a context manager: leaving releases the images, and frees the sequence when
    an error leaves it."""

    seq: Sequence
    reused: int
    restored: list[RestoredImage]
    store: dict[bytes, tuple[int, int]]
    stats: GenerationStats

    def __enter__(self) -> "Plan":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.release()
        else:
            self.abandon()

    def release(self) -> None:
        """Lets the restored images go (the request no longer reads their entries)."""
        for image in self.restored:
            image.cached.release()
        self.restored = []

    def abandon(self) -> None:
        """Releases the images and frees the sequence: a prefill that failed."""
        self.release()
        self.seq.free()


class Planner:
    """Plans prefills over one arena and runs their passes: eagerly, or with the dense work of small
    passes replayed from CUDA graphs (``prefill_graph.PrefillGraphs``) when ``cuda_graphs``."""

    def __init__(self, model, arena: KVArena, requests: RequestReader, prefix_cache: PrefixCache,
                 image_kv: ImageKVStore, cuda_graphs: bool) -> None:
        self.model, self.arena, self.requests = model, arena, requests
        self.prefix_cache, self.image_kv = prefix_cache, image_kv
        use_graphs = cuda_graphs and model.device.type == "cuda" and PrefillGraphs.supports(model)
        self.prefill_graphs = PrefillGraphs(model) if use_graphs else None

    @property
    def forward(self):
        """What runs a prefill pass (``model.forward``'s contract)."""
        return self.prefill_graphs.forward if self.prefill_graphs is not None else self.model.forward

    def plan(self, request: Request, refresh: RefreshPolicy | None, options: RefreshOptions,
             held: HeldSequence | None) -> Plan:
        """The exact prefix (from ``held``, else the prefix cache), and the images after it sorted
        into restored and computed; misses are filled alone first when ``options.fill`` is
        "isolated" (then restored like hits). ``refresh`` None restores nothing. The request was
        checked first (``limits.check_request_fits``: its length, ``options.layers``)."""
        seq, reused = self._exact_prefix(request.identity, held)
        n = request.n_tokens
        stats = GenerationStats(prompt_tokens=n, reused_tokens=reused, prefill_tokens=n - reused,
                                images=len(request.images), image_spans=request.image_spans)
        plan = Plan(seq, reused, [], {}, stats)
        try:
            self._images(request, plan, refresh is not None, options.fill == "isolated")
        except BaseException:
            plan.abandon()
            raise
        return plan

    def reuse_pass(self, request: Request, plan: Plan, query_positions: list[int], observe: list[int]) -> ReusePass:
        """The pass that prefills the planned request (see ``reuse``)."""
        return ReusePass(self.model, plan.seq, request.rope, request.n_tokens, plan.reused, plan.restored,
                         functools.partial(self.requests.embed, request), query_positions, plan.store, observe,
                         forward=self.forward)

    def store_computed(self, plan: Plan, capture: PassCapture) -> None:
        """Stores the images the request computed (their KV as its first pass made it)."""
        for key in plan.store:
            self.image_kv.store(key, *capture.stored(key, self.model.config.n_layers))

    def keep(self, seq: Sequence, identity: list, held: HeldSequence | None) -> None:
        """Gives a finished request's sequence (its tokens' ``identity``; [] for one that no longer
        holds its prompt exactly) to the session that ran it, or to the prefix cache."""
        if held is None:
            self.prefix_cache.insert(identity, seq)
        else:
            held.seq, held.identity = seq, identity

    def _exact_prefix(self, identity: list, held: HeldSequence | None) -> tuple[Sequence, int]:
        """A sequence holding the longest known exact prefix of the prompt, and its length. A held
        sequence is taken out of its session until the request gives it back (``keep``)."""
        if held is not None and held.seq is not None:
            seq, reused = held.seq, common_prefix(held.identity, identity)
            held.seq, held.identity = None, []
        else:
            seq, reused = self.prefix_cache.longest(identity)
            if seq is None:
                return self.arena.new_sequence(), 0
        reused = min(reused, len(identity) - 1)  # the last prompt token is always computed: its logits
        seq.truncate(reused)
        return seq, reused

    def _images(self, request: Request, plan: Plan, restore: bool, isolated: bool) -> None:
        """Sorts the images after the exact prefix into restored (cache hit) and computed (miss, to
        be stored as the request computes them). The images to restore that are on disk only are
        loaded together first (``ImageKVStore.preloaded``): a 7B-class entry is ~300 MB to read and
        check, and the request waits for all of them."""
        slots = request.prompt.image_slots
        wanted = {request.keys[s.image_index]: s.n_tokens for s in slots if restore and s.start >= plan.reused}
        with self.image_kv.preloaded(wanted):
            for slot in slots:
                self._sort_image(request, plan, slot, restore, isolated)

    def _sort_image(self, request: Request, plan: Plan, slot: ImageSlot, restore: bool, isolated: bool) -> None:
        """One image slot of ``_images``: restored, filled alone then restored, or to be computed."""
        stats = plan.stats
        key = request.keys[slot.image_index]
        if slot.start + slot.n_tokens <= plan.reused:
            stats.image_hits += 1  # inside the exact prefix
            return
        cached = self.image_kv.acquire(key, slot.n_tokens) if restore and slot.start >= plan.reused else None
        if cached is not None:
            stats.image_hits += 1
            stats.image_disk_hits += cached.from_disk
            plan.restored.append(RestoredImage(slot, cached))
            return
        stats.image_misses += 1
        if restore and isolated and self.image_kv.enabled:
            self._fill_isolated(request, slot)  # then restored and refreshed like a hit
            cached = self.image_kv.acquire(key)
            if cached is not None:
                plan.restored.append(RestoredImage(slot, cached))
                return
        if self.image_kv.enabled and key not in plan.store and not self.arena.has_image(key):
            plan.store[key] = (slot.start, slot.start + slot.n_tokens)  # stored as this request computes it

    def _fill_isolated(self, request: Request, slot: ImageSlot) -> None:
        """Computes an image's KV alone in a one-image chat wrapper and stores it."""
        wrapper = self.requests.alone(request, slot)
        key = request.keys[slot.image_index]
        (image_slot,) = wrapper.prompt.image_slots
        span = {key: (image_slot.start, image_slot.start + image_slot.n_tokens)}
        seq = self.arena.new_sequence()
        try:
            fill = ReusePass(self.model, seq, wrapper.rope, wrapper.n_tokens, 0, [],
                             functools.partial(self.requests.embed, wrapper), [], span, forward=self.forward)
            _, capture = fill.run(None, 0.0, RefreshOptions())
            self.image_kv.store(key, *capture.stored(key, self.model.config.n_layers))
        finally:
            seq.free()
