"""The Runtime: load a converted model and answer chat requests on the native KV arena.

The request path, top-down (``Runtime._run``), one owner per step:
  1. messages -> chat template -> token ids and segments        (chat.build_prompt)
  2. images -> pixels -> identity, prepared tower input         (preprocess, model.prepare_image)
  3. plan: the exact prefix already in the arena (chat session or prefix cache), and which images
     are restored from the image-KV store                        (PrefixCache, ImageKVStore)
  4. prefill: restore, text pass, score, select, recompute     (reuse.ReusePass, refresh policies)
  5. decode: sample, append, forward one token at a time; stream text (sampling, tokenizer)
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import native
from .convert.cache import model_files
from .chat import ImageSlot, Prompt, TextRun, build_prompt, validate_messages
from .decode_graph import GraphedDecoder
from .prefill_graph import PrefillGraphs
from .errors import ArenaFullError, DeviceUnavailableError, RequestError
from .image_cache import DecodedImages, EmbeddingCache, ImageKVStore
from .models.base import ForwardBatch, PreparedImage
from .prefix_cache import PrefixCache, common_prefix
from .preprocess import encoded_bytes, image_key, to_rgb_array
from . import compress as compression
from .compress import CompressionPolicy, CompressOptions, PromptStats, Recompressor
from .refresh import RefreshOptions, RefreshPolicy, get_policy
from .results import GenerationResult, GenerationStats, TextStream
from .reuse import ReusePass, RestoredImage
from .sampling import Sampler, SamplingParams, TokenReadback

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT_TOKENS = 32768


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for ``"auto"`` (CUDA when both torch and the native library can use it, else
    the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises DeviceUnavailableError, listing the devices available, for a string torch cannot parse,
    a device type other than cpu or cuda, or a CUDA device that torch or the native library lacks.
    """
    cuda_usable = torch.cuda.is_available() and native.backends()["cuda"]["available"]
    if str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if cuda_usable else torch.device("cpu")
    available = ["cpu"] + ([f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda_usable else [])
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise DeviceUnavailableError(f"unknown device {str(device)!r}: use auto, cpu, cuda or cuda:N "
                                     f"(available here: {', '.join(available)})")
    if resolved.type == "cpu":
        return resolved
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {str(device)!r}: torch sees no CUDA device here; "
                                     "use --device cpu (available here: cpu)")
    if not native.backends()["cuda"]["available"]:
        raise DeviceUnavailableError(f"device {str(device)!r}: the native library {native.find_library()} has no "
                                     "usable CUDA backend; use a CUDA build (CONDUIT_LIB) or --device cpu "
                                     "(available here: cpu)")
    if resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        raise DeviceUnavailableError(f"no device {str(device)!r}: available here: {', '.join(available)}")
    return resolved


@dataclass(frozen=True, slots=True)
class RefreshSpec:
    """How a request treats cached images: ``policy`` None means never restore (exact prefill)."""

    policy: RefreshPolicy | None
    ratio: float
    options: RefreshOptions

    @classmethod
    def build(cls, refresh: str | None, ratio: float, options: RefreshOptions | dict | None) -> "RefreshSpec":
        if isinstance(options, dict):
            options = RefreshOptions(**options)
        return cls(get_policy(refresh) if refresh else None, float(ratio), options or RefreshOptions())


@dataclass(frozen=True, slots=True)
class CompressSpec:
    """How a request compresses its KV after prefill: ``policy`` None keeps everything."""

    policy: CompressionPolicy | None
    keep: float
    options: CompressOptions

    @classmethod
    def build(cls, compress: str | None, keep: float, options: CompressOptions | dict | None) -> "CompressSpec":
        if isinstance(options, dict):
            options = CompressOptions(**options)
        return cls(compression.get_policy(compress) if compress else None, float(keep), options or CompressOptions())


@dataclass(frozen=True, slots=True)
class _Request:
    """One request after tokenization: what every later step of the path reads."""

    prompt: Prompt
    payloads: list                 # the images as the caller gave them
    images: list[PreparedImage]
    keys: list[bytes]              # 32-byte identity of each image
    rope: torch.Tensor             # int32 [n] or [3, n], CPU
    identity: list                 # one hashable entry per prompt token (exact-prefix matching)
    token_ids: np.ndarray = field(init=False)  # int64 [n]: prompt.token_ids, indexed by position arrays

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", np.asarray(self.prompt.token_ids, dtype=np.int64))

    @property
    def next_rope(self) -> int:
        """RoPE position of the first generated token."""
        return int(self.rope.max()) + 1 if self.rope.numel() else 0

    def post_vision_positions(self) -> list[int]:
        """VL-Cache's P: the tokens after the last image (no image: the last 32 tokens)."""
        n = len(self.prompt.token_ids)
        slots = self.prompt.image_slots
        start = slots[-1].start + slots[-1].n_tokens if slots else max(0, n - 32)
        return list(range(start, n))

    def query_positions(self, query_tokens: int | None) -> list[int]:
        """The query rows of scoring: the trailing text segment, or the last ``query_tokens`` tokens."""
        n = len(self.prompt.token_ids)
        if query_tokens is not None:
            return list(range(max(0, n - query_tokens), n))
        tail = self.prompt.segments[-1]
        return list(range(tail.start, n)) if isinstance(tail, TextRun) else [n - 1]


class Runtime:
    """A converted model, ready to chat.

    Args:
        model_path: the text model GGUF (``model.gguf``), a folder holding it, or a Hugging Face
            checkpoint folder (converted to GGUF on first use and cached: ``convert.cache``).
        mmproj: the vision GGUF (``mmproj.gguf``); default: ``mmproj.gguf`` beside the model if present.
        device: "auto" (CUDA when available), "cpu" or "cuda[:N]".
        dtype: weights and KV dtype; default bfloat16 on CUDA, float32 on CPU.
        kv_cache_bytes: size of the KV arena; default: room for 32K tokens (capped at half of the
            free GPU memory).
        image_cache_bytes: the image-KV store's LRU budget inside the arena (default: a quarter of
            it); the embedding cache gets a sixteenth of this on top, and the decoded pixels of
            recurring image files (``image_cache.DecodedImages``) a sixty-fourth (at least 16 MiB;
            none when this is 0).
        prefix_cache_entries: recent sequences kept for exact-prefix reuse across requests.
        cuda_graphs: on a CUDA device, replay each decode step from a captured CUDA graph
            (``decode_graph.GraphedDecoder``) instead of launching it from Python, and the dense work
            of prefill passes of up to 1024 tokens between their attentions
            (``prefill_graph.PrefillGraphs``).
    """

    def __init__(self, model_path: str | Path, mmproj: str | Path | None = None, device: str | torch.device = "auto",
                 dtype: torch.dtype | None = None, kv_cache_bytes: int | None = None,
                 image_cache_bytes: int | None = None, prefix_cache_entries: int = 4, cuda_graphs: bool = True) -> None:
        from .models import load_model

        self.device = resolve_device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model_path, mmproj = model_files(model_path, mmproj)
        self._attach(load_model(model_path, mmproj, self.device, self.dtype), kv_cache_bytes, image_cache_bytes,
                     prefix_cache_entries, cuda_graphs)
        logger.info("runtime: %s on %s (%s), KV arena %.1f MiB", model_path.name, self.device, self.dtype,
                    self.arena.kv_bytes / 2**20)

    @classmethod
    def from_model(cls, model, kv_cache_bytes: int | None = None, image_cache_bytes: int | None = None,
                   prefix_cache_entries: int = 4, cuda_graphs: bool = True) -> "Runtime":
        """A Runtime over an already-built model (no files read; benchmarks build one with random
        weights): its device and dtype are the model's; the other arguments are as in ``__init__``."""
        runtime = cls.__new__(cls)
        runtime.device, runtime.dtype = model.device, model.dtype
        runtime._attach(model, kv_cache_bytes, image_cache_bytes, prefix_cache_entries, cuda_graphs)
        return runtime

    def _attach(self, model, kv_cache_bytes: int | None, image_cache_bytes: int | None,
                prefix_cache_entries: int, cuda_graphs: bool) -> None:
        """Takes the model, sizes the KV arena and creates the caches over it."""
        self.model = model
        self.assets = self.model.assets  # tokenizer, chat template, preprocessing, ids
        # what every image key hashes besides the pixels (computed once: asdict is slow per request)
        self._image_params = self.assets.preprocess.as_dict() if self.assets.preprocess is not None else {}
        kv_bytes = self._kv_bytes(kv_cache_bytes)
        image_bytes = kv_bytes // 4 if image_cache_bytes is None else int(image_cache_bytes)
        self.arena = self.model.new_arena(kv_bytes, image_cache_bytes=image_bytes)
        self.image_kv = ImageKVStore(self.arena)
        self.embeddings = EmbeddingCache(max(image_bytes // 16, 1 << 20))
        # pixels of recurring image files; none when image caching is off
        self.decoded_images = DecodedImages(max(image_bytes // 64, 16 << 20) if image_bytes > 0 else 0)
        self.prefix_cache = PrefixCache(prefix_cache_entries)
        graphs = cuda_graphs and self.device.type == "cuda"
        self.graphed_decoder = GraphedDecoder(model, self.arena) if graphs else None
        self.prefill_graphs = PrefillGraphs(model) if graphs and PrefillGraphs.supports(model) else None

    def _kv_bytes(self, requested: int | None) -> int:
        if requested is not None:
            return int(requested)
        c = self.model.config
        per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.tensor([], dtype=self.dtype).element_size()
        want = per_token * DEFAULT_CONTEXT_TOKENS
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            want = min(want, free // 2)
        return want

    # -- public API -----------------------------------------------------------------------------------
    def generate(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop: str | list[str] | None = None, return_logits: bool = False,
                 refresh: str | None = None, refresh_budget: float = 0.1,
                 refresh_options: RefreshOptions | dict | None = None, compress: str | None = None,
                 keep: float = 0.1, compress_options: CompressOptions | dict | None = None) -> GenerationResult:
        """Answers the messages (OpenAI chat style, images as parts) in one go.

        refresh: None restores no image KV (every token not in an exact prefix is computed); a policy
        name ("conduit", "full", "none", "first", "random", "attention", "cacheblend") restores
        cached images at their new positions and recomputes ``refresh_budget`` of their tokens.
        compress: None keeps the whole KV; a policy name ("vlcache", "none", "random", "streamingllm",
        "h2o", "snapkv", "pyramidkv") keeps ``keep`` of the prompt's KV for decoding.
        """
        stream = self.stream(messages, max_tokens, temperature, top_p, seed, stop, return_logits, refresh,
                             refresh_budget, refresh_options, compress, keep, compress_options)
        for _ in stream:
            pass
        return stream.result

    def stream(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop: str | list[str] | None = None, return_logits: bool = False,
               refresh: str | None = None, refresh_budget: float = 0.1,
               refresh_options: RefreshOptions | dict | None = None, compress: str | None = None,
               keep: float = 0.1, compress_options: CompressOptions | dict | None = None) -> TextStream:
        """Like ``generate``, yielding text pieces as they decode; ``.result`` holds the whole answer."""
        sampling = SamplingParams.build(max_tokens, temperature, top_p, seed, stop)
        spec = RefreshSpec.build(refresh, refresh_budget, refresh_options)
        squeeze = CompressSpec.build(compress, keep, compress_options)
        holder: list = []
        return TextStream(self._run(messages, sampling, spec, squeeze, return_logits, None, holder), holder)

    def chat(self) -> "ChatSession":
        """A multi-turn session that keeps its sequence in the arena between turns."""
        from .session import ChatSession

        return ChatSession(self)

    # -- the request path -----------------------------------------------------------------------------
    def _run(self, messages: list[dict], sampling: SamplingParams, spec: RefreshSpec, squeeze: CompressSpec,
             return_logits: bool, turn: Any, holder: list) -> Iterator[str]:
        start = time.perf_counter()
        request = self._request(messages)                                             # 1, 2
        try:
            seq, logits, stats, capture = self._prefill_planned(request, spec, squeeze, turn)  # 3, 4
        except ArenaFullError:  # kept prefixes may hold the room: drop them and try once more
            self.prefix_cache.clear()
            seq, logits, stats, capture = self._prefill_planned(request, spec, squeeze, turn)
        recompress = self._compress(seq, request, capture, squeeze, stats)           # 5 (optional)
        try:
            yield from self._decode(seq, logits, request, sampling, return_logits, stats, start, holder,
                                    recompress)                                       # 6
        finally:
            generated = holder[0].tokens if holder else []
            # a compressed sequence no longer holds its prompt exactly: never an exact prefix again
            identity = [] if squeeze.policy else (request.identity + [("t", t) for t in generated])[: seq.n_tokens(0)]
            if turn is None:
                self.prefix_cache.insert(identity, seq)
            else:
                turn.seq, turn.identity = seq, identity

    def _request(self, messages: list[dict]) -> _Request:
        """Messages -> prompt tokens and segments, prepared images, their identities, RoPE positions."""
        a = self.assets
        _, payloads = validate_messages(messages)
        if payloads and not self.model.has_vision:
            raise RequestError("this model has no vision tower: load it with its mmproj.gguf to send images")
        pixels, keys = self._decode_images(payloads)
        images = [self.model.prepare_image(rgb) for rgb in pixels]
        prompt = build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id,
                              [image.n_tokens for image in images])
        rope = self.model.rope_positions(prompt, images)
        return _Request(prompt, payloads, images, keys, rope, _identity(prompt, keys))

    def _decode_images(self, payloads: list) -> tuple[list[np.ndarray], list[bytes]]:
        """Each image's RGB pixels ([H, W, 3] uint8) and cache key, in order.

        An image sent as a file (a path or bytes) that this runtime decoded before comes from
        ``decoded_images`` by the sha256 of the file: no decoding, no hash of its pixels. The rest
        go through a thread pool (hashing releases the GIL; 8 PIL images of 336 x 336 took ~3 ms on
        an H200's host one after another, 2.6 ms in the pool, before any GPU work of the request
        could start). Each distinct payload object is decoded once, by one thread: a lazily opened
        PIL image shown twice must not be loaded by two threads at once (they would share its file
        pointer)."""
        def decoded(payload) -> tuple[np.ndarray, bytes]:
            encoded = encoded_bytes(payload)
            if encoded is None:  # a PIL image or an array: its pixels are the only identity
                rgb = to_rgb_array(payload)
                return rgb, image_key(rgb, self._image_params, self.assets.vision_model_id)
            digest = self.decoded_images.digest(encoded)
            known = self.decoded_images.get(digest)
            if known is not None:
                return known
            name = os.fspath(payload) if isinstance(payload, (str, os.PathLike)) else None
            rgb = to_rgb_array(encoded, name)
            key = image_key(rgb, self._image_params, self.assets.vision_model_id)
            self.decoded_images.put(digest, rgb, key)
            return rgb, key

        distinct = list({id(payload): payload for payload in payloads}.values())
        results = list(_image_pool().map(decoded, distinct)) if len(distinct) > 1 else [decoded(p) for p in distinct]
        by_object = {id(payload): result for payload, result in zip(distinct, results)}
        return [by_object[id(p)][0] for p in payloads], [by_object[id(p)][1] for p in payloads]

    def _prefill_planned(self, request: _Request, spec: RefreshSpec, squeeze: CompressSpec,
                         turn: Any) -> tuple[Any, torch.Tensor, GenerationStats, Any]:
        """Plans the exact prefix and the restored images, then runs the prefill (``ReusePass``)."""
        layers, n_layers = spec.options.layers, self.model.config.n_layers
        if layers is not None and any(not 0 <= layer < n_layers for layer in layers):
            raise RequestError(f"refresh layers must be in [0, {n_layers}), got {list(layers)}")
        seq, reused = self._exact_prefix(turn, request.identity)
        n = len(request.prompt.token_ids)
        stats = GenerationStats(prompt_tokens=n, reused_tokens=reused, prefill_tokens=n - reused,
                                images=len(request.images))
        restored = []
        try:
            restored, store = self._plan_images(request, reused, spec, stats)
            reuse = ReusePass(self.model, seq, request.rope, n, reused, restored,
                              lambda positions: self._embeddings(request, positions),
                              request.query_positions(spec.options.query_tokens), store,
                              self._observed(request, squeeze), forward=self._pass_forward())
            logits, capture = reuse.run(spec.policy, spec.ratio, spec.options)
            for key in store:
                self.image_kv.store(key, *capture.stored(key, self.model.config.n_layers))
        except BaseException:
            seq.free()
            raise
        finally:
            for image in restored:
                image.cached.release()
        r = reuse.stats
        stats.visual_tokens, stats.refreshed_tokens = r.visual_tokens, r.refreshed_tokens
        stats.recomputed_token_layers = r.recomputed_token_layers
        stats.prefill_flops_ratio = r.prefill_flops / r.full_prefill_flops if r.full_prefill_flops else 0.0
        return seq, logits, stats, capture

    @staticmethod
    def _observed(request: _Request, squeeze: CompressSpec) -> list[int]:
        """Prompt positions whose final q compression needs (P, the SnapKV window, or all for H2O)."""
        if squeeze.policy is None:
            return []
        n = len(request.prompt.token_ids)
        if squeeze.policy.observe_all:
            return list(range(n))
        return sorted(set(request.post_vision_positions()) | set(range(max(0, n - squeeze.options.window), n)))

    def _compress(self, seq, request: _Request, capture, squeeze: CompressSpec,
                  stats: GenerationStats) -> Recompressor | None:
        """Keeps ``squeeze.keep`` of the prompt's KV per layer (compaction frees the rest)."""
        if squeeze.policy is None:
            return None
        c = self.model.config
        post_vision = request.post_vision_positions()
        prompt_stats = PromptStats(seq, c.n_layers, c.n_heads, c.attention_scale, capture.queries, post_vision,
                                   squeeze.options)
        stats.kv_bytes_before_compress = seq.nbytes
        kept = squeeze.policy.keep(prompt_stats, squeeze.keep)
        for layer, slots in enumerate(kept):
            seq.compact(layer, slots)
        stats.kv_bytes_after_compress = seq.nbytes
        stats.kept_tokens_per_layer = [len(slots) for slots in kept]
        every = squeeze.options.recompress_every
        return Recompressor(seq, stats.kept_tokens_per_layer, every, post_vision, c.attention_scale) if every else None

    def _exact_prefix(self, turn: Any, identity: list) -> tuple[Any, int]:
        """A sequence holding the longest known exact prefix of the prompt, and its length."""
        if turn is not None and turn.seq is not None:
            seq, reused = turn.seq, common_prefix(turn.identity, identity)
        else:
            seq, reused = self.prefix_cache.longest(identity)
            if seq is None:
                return self.arena.new_sequence(), 0
        reused = min(reused, len(identity) - 1)  # the last prompt token is always computed: its logits
        seq.truncate(reused)
        return seq, reused

    def _plan_images(self, request: _Request, reused: int, spec: RefreshSpec,
                     stats: GenerationStats) -> tuple[list[RestoredImage], dict[bytes, tuple[int, int]]]:
        """Sorts the images after the exact prefix into restored (cache hit) and computed (miss, to
        be stored as the request computes them)."""
        restored, store = [], {}
        for slot in request.prompt.image_slots:
            key = request.keys[slot.image_index]
            if slot.start + slot.n_tokens <= reused:
                stats.image_hits += 1  # inside the exact prefix
                continue
            cached = self.image_kv.acquire(key) if spec.policy is not None and slot.start >= reused else None
            if cached is not None:
                stats.image_hits += 1
                restored.append(RestoredImage(slot, cached))
                continue
            stats.image_misses += 1
            if spec.policy is not None and spec.options.fill == "isolated" and self.image_kv.enabled:
                self._fill_isolated(request, slot)  # then restored and refreshed like a hit
                cached = self.image_kv.acquire(key)
                if cached is not None:
                    restored.append(RestoredImage(slot, cached))
                    continue
            if self.image_kv.enabled and key not in store and not self.arena.has_image(key):
                store[key] = (slot.start, slot.start + slot.n_tokens)  # stored as this request computes it
        return restored, store

    def _fill_isolated(self, request: _Request, slot: ImageSlot) -> None:
        """Computes an image's KV alone in a one-image chat wrapper and stores it."""
        a = self.assets
        payload, image = request.payloads[slot.image_index], request.images[slot.image_index]
        messages = [{"role": "user", "content": [{"type": "image", "image": payload}]}]
        prompt = build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id, [image.n_tokens])
        key = request.keys[slot.image_index]
        wrapper = _Request(prompt, [payload], [image], [key], self.model.rope_positions(prompt, [image]), [])
        (image_slot,) = prompt.image_slots
        span = {key: (image_slot.start, image_slot.start + image_slot.n_tokens)}
        seq = self.arena.new_sequence()
        try:
            fill = ReusePass(self.model, seq, wrapper.rope, len(prompt.token_ids), 0, [],
                             lambda positions: self._embeddings(wrapper, positions), [], span,
                             forward=self._pass_forward())
            _, capture = fill.run(None, 0.0, RefreshOptions())
            self.image_kv.store(key, *capture.stored(key, self.model.config.n_layers))
        finally:
            seq.free()

    def _pass_forward(self):
        """What runs a prefill pass: the graph-replayed one on CUDA (unless cuda_graphs=False)."""
        return self.prefill_graphs.forward if self.prefill_graphs is not None else self.model.forward

    def _embeddings(self, request: _Request, positions: list[int]) -> torch.Tensor:
        """Input embeddings of prompt positions: [len(positions), hidden], model dtype; image tokens
        take their image's features (from the embedding cache, or the vision tower on a miss).

        The index arithmetic runs in numpy and reaches the device in one non-blocking upload (a
        blocking one waits for every kernel queued before it); per image, one gather and one
        scatter. The recompute pass calls this right after the selection's host sync, with the device
        idle until its first launch."""
        pos = np.asarray(positions, dtype=np.int64)
        pieces, spans = [request.token_ids[pos]], []  # spans: (image index, length) per image shown
        for slot in request.prompt.image_slots:
            rows = np.flatnonzero((pos >= slot.start) & (pos < slot.start + slot.n_tokens))
            if rows.size:
                pieces += [rows, pos[rows] - slot.start]
                spans.append((slot.image_index, rows.size))
        index = torch.from_numpy(np.concatenate(pieces)).to(self.device, non_blocking=True)
        embeds = self.model.embed_tokens(index[: pos.size])
        offset = pos.size
        for image_index, n in spans:
            rows, features_rows = index[offset: offset + n], index[offset + n: offset + 2 * n]
            embeds[rows] = self._image_features(request, image_index)[features_rows]
            offset += 2 * n
        return embeds

    def _image_features(self, request: _Request, image_index: int) -> torch.Tensor:
        key = request.keys[image_index]
        features = self.embeddings.get(key)
        if features is None:
            (features,) = self.model.encode_images([request.images[image_index]])
            self.embeddings.put(key, features)
        return features

    def _decode(self, seq, logits: torch.Tensor, request: _Request, sampling: SamplingParams, return_logits: bool,
                stats: GenerationStats, start: float, holder: list,
                recompress: Recompressor | None = None) -> Iterator[str]:
        detok = self.assets.tokenizer.detokenizer()
        eos = self.assets.eos_token_ids
        tokens: list[int] = []
        step_logits: list[torch.Tensor] | None = [] if return_logits else None
        text, emitted = "", 0
        finish = "length"
        hold_back = max((len(s) for s in sampling.stop), default=1) - 1
        decode_start = None
        sampled = self._sampled_tokens(seq, logits, request, sampling, step_logits, recompress)
        try:
            for token in sampled:
                if decode_start is None:
                    stats.ttft_s = time.perf_counter() - start
                    decode_start = time.perf_counter()
                if token in eos:
                    finish = "eos"
                    break
                tokens.append(token)
                text += detok.push(token)
                cut = _find_stop(text, sampling.stop)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                if len(text) - hold_back > emitted:
                    yield text[emitted: len(text) - hold_back]
                    emitted = len(text) - hold_back
        finally:
            sampled.close()  # undoes a step run ahead for a token that ended the answer
        if finish != "stop":  # release characters the detokenizer held back (an unfinished byte run)
            text += detok.flush()
            cut = _find_stop(text, sampling.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
        if len(text) > emitted:
            yield text[emitted:]
        end = time.perf_counter()
        stats.decode_tokens = len(tokens)
        stats.decode_s = end - decode_start if decode_start else 0.0
        stats.decode_tokens_per_s = (len(tokens) - 1) / stats.decode_s if stats.decode_s > 0 and len(tokens) > 1 else 0.0
        stats.total_s = end - start
        stats.finish_reason = finish
        stats.kv_bytes = seq.nbytes
        holder.append(GenerationResult(text=text, tokens=tokens, stats=stats,
                                       logits=torch.stack(step_logits) if step_logits else None))

    def _sampled_tokens(self, seq, logits: torch.Tensor, request: _Request, sampling: SamplingParams,
                        step_logits: list[torch.Tensor] | None, recompress: Recompressor | None) -> Iterator[int]:
        """Samples up to ``max_tokens`` tokens from ``logits`` (the prompt's last row) and the decode
        steps that follow, yielding each token id as the caller accepts them one by one.

        From the second token on, the step that consumes a token is enqueued before the token reaches
        the host (the sampled id goes to the step on the device; only the host copy is waited for), so
        the GPU runs step i while the caller detokenizes and streams token i: the host's share of a
        step (preparing it, filling its inputs, detokenizing) no longer adds to the GPU's. A token the
        caller stops at (EOS, a stop string) then has a step it should not have had: closing the
        generator truncates it from the sequence, which ends as it would have without running ahead.
        The first token goes out before any step is enqueued: time to first token never waits for one
        (nor for a first step's graph capture). ``step_logits`` collects each step's logits (CPU).
        """
        sampler = Sampler(sampling, self.device)
        readback = TokenReadback(self.device)
        first_position = len(request.prompt.token_ids)
        ahead = None  # position of a step enqueued for a token the caller has not accepted yet
        try:
            for i in range(sampling.max_tokens):
                if step_logits is not None:
                    step_logits.append(logits.float().cpu())
                token = sampler(logits)
                readback.start(token)
                position, rope_position = first_position + i, request.next_rope + i
                more = i + 1 < sampling.max_tokens
                if more and i > 0:
                    logits = self._step(seq, token, position, rope_position, recompress)
                    ahead = position
                yield readback.wait()
                ahead = None
                if more and i == 0:
                    logits = self._step(seq, token, position, rope_position, recompress)
                if more and recompress is not None:
                    recompress.after_step(position)
        finally:
            if ahead is not None:
                seq.truncate(ahead)

    def _step(self, seq, token: torch.Tensor, position: int, rope_position: int, capture=None) -> torch.Tensor:
        """One decode step: the token (int64 scalar on the device) at causal ``position`` -> next-token
        logits [vocab]. Replayed from a CUDA graph when there is one and no layer observer needs the
        eager path."""
        if self.graphed_decoder is not None and capture is None:
            return self.graphed_decoder.step(seq, token, position, rope_position)
        # full_ writes the scalars on the device (no blocking host-to-device copy)
        positions = torch.full((1,), position, dtype=torch.int32, device=self.device)
        seq.append([position])
        embeds = self.model.embed_tokens(token.reshape(1))
        rows = (3, 1) if self.model.config.rope.sections else (1,)
        rope = torch.full(rows, rope_position, dtype=torch.int32, device=self.device)
        hidden = self.model.forward(seq, embeds, ForwardBatch(positions=positions, rope_positions=rope), capture)
        return self.model.logits(hidden)[0]


@functools.cache
def _image_pool() -> ThreadPoolExecutor:
    """The threads that decode and hash a request's images (one pool per process)."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="conduit-images")


# A forked child inherits the cached pool without its threads: it makes its own.
os.register_at_fork(after_in_child=_image_pool.cache_clear)


def _identity(prompt: Prompt, keys: list[bytes]) -> list:
    """One hashable entry per prompt token: ("t", id) for text, ("i", image key, index) for image tokens."""
    ids, out, cursor = prompt.token_ids, [], 0
    for slot in sorted(prompt.image_slots, key=lambda s: s.start):
        out += [("t", t) for t in ids[cursor: slot.start]]
        out += _image_identity(keys[slot.image_index], slot.n_tokens)
        cursor = slot.start + slot.n_tokens
    return out + [("t", t) for t in ids[cursor:]]


@functools.lru_cache(maxsize=256)
def _image_identity(key: bytes, n_tokens: int) -> tuple:
    """An image's identity entries, made once per image (a request of 8 images took ~1.4 ms to build
    its 4.6K tuples)."""
    return tuple(("i", key, j) for j in range(n_tokens))


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(cuts) if cuts else None
