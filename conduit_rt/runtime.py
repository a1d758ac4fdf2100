"""The Runtime: load a converted model and answer chat requests on the native KV arena.

The request path (``Runtime.start`` for steps 1-4, then the decoder, then ``Runtime.finish``; one
generator, ``Runtime._answer``, for ``generate`` and ``stream``), one part per step:
  1. request: messages -> chat template -> token ids and segments; images -> pixels -> identity and
     tower input; RoPE positions                                    (request.RequestReader)
  2. plan: the exact prefix already in the arena (a chat session's sequence or the prefix cache),
     the images restored from the image-KV store, isolated fills   (planning.Planner)
  3. prefill: restore, text pass, the refresh policy's recompute   (reuse.ReusePass, refresh)
  4. compression of the prompt's KV, when asked                    (compress.compress_prompt)
  5. decode: sample, append, forward one token at a time; stream text (decoding.Decoder)

Threads: every piece of that work holds the Runtime's ``lock`` (``locking.RequestLock``), per
request phase and per decode step; see the ``Runtime`` docstring.
"""
from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import native
from .arena import Sequence
from .capture import PassCapture
from .compress import Recompressor, compress_prompt
from .convert.cache import model_files
from .decoding import Decoder
from .disk_cache import DEFAULT_CACHE_DIR_BYTES, DiskCacheStats, DiskImageStore
from .disk_entry import EntryLayout, model_fingerprint
from .errors import ArenaFullError, DeviceUnavailableError
from .image_cache import DecodedImages, EmbeddingCache, ImageKVStore
from .limits import check_request_fits, check_runtime_arguments
from .locking import RequestLock
from .options import GenerationOptions
from .parallel.group import model_group
from .planning import HeldSequence, Planner
from .prefix_cache import PrefixCache
from .request import Request, RequestReader
from .results import GenerationResult, GenerationStats, TextStream

if TYPE_CHECKING:
    from .session import ChatSession

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
class _Prefilled:
    """A request after its prefill: its sequence, the last prompt token's logits (float32 [vocab]),
    its statistics so far, and what the passes kept of each layer."""

    seq: Sequence
    logits: torch.Tensor
    stats: GenerationStats
    capture: PassCapture


@dataclass(frozen=True, slots=True)
class StartedRequest:
    """A request read, prefilled and compressed, ready to decode (``Runtime.start``): its sequence
    (the prompt's KV), the last prompt token's logits (float32 [vocab]), its statistics so far, the
    decode steps' re-compression (None: none asked for), and ``start``, its perf_counter start. The
    first generated token goes at causal position ``request.n_tokens``, RoPE position
    ``request.next_rope``."""

    request: Request
    options: GenerationOptions
    seq: Sequence
    logits: torch.Tensor
    stats: GenerationStats
    recompress: Recompressor | None
    start: float


class Runtime:
    """A converted model, ready to chat: the model and its KV arena, and the parts of the request
    path over them (``requests``, ``planner``, ``decoder``; see the module docstring).

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
        cache_dir: a folder where the image-KV store's entries also go (``disk_cache``): each
            image's pre-RoPE K and V of every layer, value norms and embedding, with the model's
            identity and a checksum, written by a background thread. An image missing from the
            arena is loaded from there (``GenerationStats.image_disk_hits``), so a Runtime started
            again over the same folder answers as a warm one would (``preload_images`` loads the
            most recent entries before the first request). Unusable files (corrupted,
            truncated, another model's) are deleted and count as misses; several processes may
            share the folder. Default None: nothing on disk.
        cache_dir_bytes: the folder's LRU byte budget (default 4 GiB; the least recently used
            files go first).
        tensor_parallel: split the decoder over this many processes (see "Tensor parallel" below).
        kv_dtype: None (the KV cache in ``dtype``) or "fp8": K and V stored as e4m3 with a
            power-of-two scale per token and KV head (``arena.KV_FORMATS``; docs/design-notes.md), about
            half the bytes of bf16, so the default arena holds twice the tokens. Restores, CONDUIT's
            scoring, VL-Cache compaction and the image-KV store all work on it; the cache folder keeps
            its entries apart from those of a dense cache.
        cuda_graphs: on a CUDA device, replay each decode step from a captured CUDA graph
            (``decode_graph.GraphedDecoder``) instead of launching it from Python, and the dense work
            of prefill passes of up to 1024 tokens between their attentions
            (``prefill_graph.PrefillGraphs``).

    Threads: one Runtime may serve any number of threads. Its work is serialised by one re-entrant
    lock (``lock``), taken for a request's read and prefill (its stream's first step), for each
    decode step, and for the end of a request; the streams of several threads interleave step by
    step. Everything requests share (the KV arena, the prefix cache, the image-KV store, the
    embedding and decoded-image caches, the CUDA graphs) is touched only under it, so a request
    gets the answer it would get alone on the caches as its prefill found them: the serial answer
    whenever the order of requests cannot change what the caches hold for it. A ``ChatSession`` is
    one conversation: send its turns one after another. A stream dropped unfinished gives its
    sequence back when it is garbage-collected (or at the end of the step another thread was
    running then), and ``close`` ends every open stream.

    Lifetime: ``close`` (or leaving a ``with Runtime(...) as runtime:`` block) ends the open streams
    and frees the KV arena, the caches and the CUDA graphs; later calls raise RuntimeClosedError.
    Runtimes still open at interpreter exit are closed then, before the interpreter tears down.

    Tensor parallel: ``Runtime(..., tensor_parallel=N)`` with N > 1 returns a
    ``parallel.driver.ParallelRuntime`` (the same ``generate``, ``stream``, ``chat`` and ``close``),
    which runs this request path in N processes, each over its share of the decoder.
    """

    def __new__(cls, *args, tensor_parallel: int = 1, **kwargs):
        if tensor_parallel == 1:
            return super().__new__(cls)
        from .parallel.driver import ParallelRuntime

        return ParallelRuntime(*args, tensor_parallel=tensor_parallel, **kwargs)

    def __init__(self, model_path: str | Path, mmproj: str | Path | None = None, device: str | torch.device = "auto",
                 dtype: torch.dtype | None = None, kv_cache_bytes: int | None = None,
                 image_cache_bytes: int | None = None, prefix_cache_entries: int = 4, cuda_graphs: bool = True,
                 cache_dir: str | Path | None = None, cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES,
                 tensor_parallel: int = 1, kv_dtype: str | None = None) -> None:
        from .models import load_model

        check_runtime_arguments(dtype, kv_cache_bytes, image_cache_bytes, prefix_cache_entries, cuda_graphs,
                                cache_dir, cache_dir_bytes, kv_dtype)
        self.device = resolve_device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model_path, mmproj = model_files(model_path, mmproj)
        self._attach(load_model(model_path, mmproj, self.device, self.dtype), kv_cache_bytes, image_cache_bytes,
                     prefix_cache_entries, cuda_graphs, source=str(model_path), cache_dir=cache_dir,
                     cache_dir_bytes=cache_dir_bytes, kv_dtype=kv_dtype)
        logger.info("runtime: %s on %s (%s), KV arena %.1f MiB", model_path.name, self.device, self.dtype,
                    self.arena.kv_bytes / 2**20)

    @classmethod
    def from_model(cls, model, kv_cache_bytes: int | None = None, image_cache_bytes: int | None = None,
                   prefix_cache_entries: int = 4, cuda_graphs: bool = True, cache_dir: str | Path | None = None,
                   cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES, kv_dtype: str | None = None) -> "Runtime":
        """A Runtime over an already-built model (no files read; benchmarks build one with random
        weights): its device and dtype are the model's; the other arguments are as in ``__init__``."""
        check_runtime_arguments(None, kv_cache_bytes, image_cache_bytes, prefix_cache_entries, cuda_graphs,
                                cache_dir, cache_dir_bytes, kv_dtype)
        runtime = cls.__new__(cls)
        runtime.device, runtime.dtype = model.device, model.dtype
        runtime._attach(model, kv_cache_bytes, image_cache_bytes, prefix_cache_entries, cuda_graphs,
                        source="the model given to Runtime.from_model", cache_dir=cache_dir,
                        cache_dir_bytes=cache_dir_bytes, kv_dtype=kv_dtype)
        return runtime

    def _attach(self, model, kv_cache_bytes: int | None, image_cache_bytes: int | None,
                prefix_cache_entries: int, cuda_graphs: bool, source: str, cache_dir: str | Path | None = None,
                cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES, kv_dtype: str | None = None) -> None:
        """Takes the model, sizes the KV arena and creates the parts and their caches over it;
        ``source`` names the model in errors."""
        self.model = model
        kv_format = "fp8" if kv_dtype == "fp8" else "dense"
        kv_bytes = _kv_bytes(model, self.dtype, self.device) if kv_cache_bytes is None else int(kv_cache_bytes)
        image_bytes = kv_bytes // 4 if image_cache_bytes is None else int(image_cache_bytes)
        self.arena = model.new_arena(kv_bytes, image_cache_bytes=image_bytes, kv_format=kv_format)
        embeddings = EmbeddingCache(max(image_bytes // 16, 1 << 20))
        disk = None
        if cache_dir is not None and image_bytes == 0:
            logger.warning("cache_dir %s is not used: image_cache_bytes=0 turns the image-KV store off", cache_dir)
        elif cache_dir is not None:
            c = model.config
            layout = EntryLayout(c.n_layers, c.n_kv_heads, c.head_dim, c.embedding_width, self.dtype)
            disk = DiskImageStore(cache_dir, cache_dir_bytes, model_fingerprint(model, kv_format), layout)
        image_kv = ImageKVStore(self.arena, disk, embeddings)
        # pixels of recurring image files; none when image caching is off
        decoded_images = DecodedImages(max(image_bytes // 64, 16 << 20) if image_bytes > 0 else 0)
        self.requests = RequestReader(model, decoded_images, embeddings)
        self.decoder = Decoder(model, self.arena, cuda_graphs, source)
        self.planner = Planner(model, self.arena, self.requests, PrefixCache(prefix_cache_entries), image_kv,
                               cuda_graphs)
        self.lock = RequestLock(self.arena.lock, self.arena.free_deferred)
        _OPEN_RUNTIMES.add(self)

    def preload_images(self) -> int:
        """Loads the cache folder's most recently used image entries of this model into the arena's
        image store, as many as its free budget holds, and returns how many (0 without a
        ``cache_dir``). A Runtime started again over its folder calls this before taking requests
        (``conduit serve --cache-dir`` does), so the first requests' images are in-memory hits
        rather than loads from disk on their path (a read and a checksum of every byte of the
        entry, where a hit costs neither). Unusable files are deleted, as on any load."""
        with self.lock:
            start = time.perf_counter()
            loaded = self.planner.image_kv.preload()
            if loaded:
                logger.info("runtime: %d image entries preloaded from the cache folder in %.2f s", loaded,
                            time.perf_counter() - start)
            return loaded

    def disk_cache_stats(self) -> DiskCacheStats | None:
        """Hits, misses, writes and evictions of the cache folder, and its size (None without one)."""
        disk = self.planner.image_kv.disk
        return disk.stats() if disk is not None else None

    @property
    def assets(self):
        """The model's tokenizer, chat template, preprocessing and special ids (``ModelAssets``)."""
        return self.model.assets

    # -- public API -----------------------------------------------------------------------------------
    def generate(self, messages: list[dict], options: GenerationOptions | None = None,
                 **overrides) -> GenerationResult:
        """Answers the messages (OpenAI chat style, images as parts) in one go. ``options`` (default:
        ``GenerationOptions()``) and ``overrides``, its field names (``max_tokens=8,
        refresh="conduit", refresh_budget=0.1``), say how: sampling, refresh, compression."""
        return self.stream(messages, options, **overrides).finish()

    def stream(self, messages: list[dict], options: GenerationOptions | None = None, *,
               held: HeldSequence | None = None, **overrides) -> TextStream:
        """Like ``generate``, yielding text pieces as they decode; ``.result`` holds the whole answer.
        ``held``: run on (and give back to) this sequence instead of the prefix cache, as a chat
        session's turns do. The work runs as the stream is iterated, each step holding ``lock``."""
        return TextStream(self._answer(messages, GenerationOptions.of(options, **overrides), held), self.lock)

    def chat(self) -> "ChatSession":
        """A multi-turn session that keeps its sequence in the arena between turns."""
        from .session import ChatSession

        self.lock.check_open()
        return ChatSession(self)

    def close(self) -> None:
        """Ends every open stream (each gives its sequence back, as a closed stream does), then frees
        the KV arena with every sequence and image entry in it, the prefix cache, the embedding and
        decoded-image caches and the CUDA graphs, after writing the entries still queued for the
        cache folder. Later calls raise RuntimeClosedError; closing again
        does nothing. Waits for the step another thread is running, if any."""
        self.lock.close(self._free)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _free(self) -> None:
        """What ``close`` frees, holding the lock once the open streams are closed."""
        self.planner.prefix_cache.clear()
        if self.decoder.graphed is not None:
            self.decoder.graphed.close()
        if self.planner.prefill_graphs is not None:
            self.planner.prefill_graphs.close()
        self.requests.embeddings.clear()
        self.requests.decoded_images.clear()
        if self.planner.image_kv.disk is not None:
            self.planner.image_kv.disk.close()  # writes the entries still queued
        self.arena.close()
        _OPEN_RUNTIMES.discard(self)

    # -- the request path -----------------------------------------------------------------------------
    def start(self, messages: list[dict], options: GenerationOptions,
              held: HeldSequence | None = None) -> StartedRequest:
        """Steps 1-4 of the request path (read, plan, prefill, compress) without decoding; hold
        ``lock`` around it. The caller decodes (``decoder``) and then gives the request back with
        ``finish``. Nothing stays allocated when it raises."""
        start = time.perf_counter()
        request = self.requests.read(messages)                                          # 1
        check_request_fits(request, options, self.model.config, self.arena)  # nothing allocated yet
        try:
            prefilled = self._prefill(request, options, held)                            # 2, 3
        except ArenaFullError:  # kept prefixes may hold the room: drop them and try once more
            self.planner.prefix_cache.clear()
            prefilled = self._prefill(request, options, held)
        try:
            recompress = self._compress(request, prefilled, options)                     # 4
        except BaseException:
            if not self.arena.closed:
                prefilled.seq.free()
            raise
        return StartedRequest(request, options, prefilled.seq, prefilled.logits, prefilled.stats, recompress, start)

    def finish(self, started: StartedRequest, result: GenerationResult | None, whole: bool,
               held: HeldSequence | None = None) -> None:
        """Ends a started request; hold ``lock`` around it. ``whole``: its sequence holds the prompt
        and the tokens decoded so far exactly (the answer ended, or its stream was closed between
        steps), so it goes to ``held`` or the prefix cache; otherwise (a step failed, its KV may be
        half written) it is freed. ``result``: the answer, None when it did not finish."""
        if whole:
            self._give_back(started.seq, started.request, started.options, result, held)
        elif not self.arena.closed:  # a failed step may have left KV half written: freed, never an exact prefix
            started.seq.free()

    def _answer(self, messages: list[dict], options: GenerationOptions,
                held: HeldSequence | None) -> Generator[str, None, GenerationResult]:
        started = self.start(messages, options, held)                                   # 1-4
        request, result, whole = started.request, None, False
        try:
            result = yield from self.decoder.run(started.seq, started.logits, request.n_tokens,  # 5
                                                 request.next_rope, options.sampling(), options.return_logits,
                                                 started.stats, started.start, started.recompress)
            whole = True
            return result
        except GeneratorExit:  # the caller closed the stream: the KV decoded so far is whole
            whole = True
            raise
        finally:
            self.finish(started, result, whole, held)

    def _give_back(self, seq: Sequence, request: Request, options: GenerationOptions,
                   result: GenerationResult | None, held: HeldSequence | None) -> None:
        """Gives a finished (or closed) request's sequence to its session or the prefix cache."""
        if self.arena.closed:  # a Runtime collected along with its arena: the sequence went with it
            return
        generated = result.tokens if result is not None else []
        # a compressed sequence no longer holds its prompt exactly: never an exact prefix again
        n_held = seq.n_tokens(0)
        identity = [] if options.compress else (request.identity + [("t", t) for t in generated])[:n_held]
        self.planner.keep(seq, identity, held)

    def _prefill(self, request: Request, options: GenerationOptions, held: HeldSequence | None) -> _Prefilled:
        """Plans the exact prefix and the restored images, then runs the prefill pass over them."""
        refresh, compression = options.refresh_policy(), options.compression_policy()
        plan = self.planner.plan(request, refresh, options.refresh_options, held)
        with plan:  # releases the restored images; frees the sequence if the prefill fails
            observe = [] if compression is None else compression.observed_positions(
                request.n_tokens, compression.query_rows(request), options.compress_options)
            queries = (request.query_positions(options.refresh_options.query_tokens) if refresh is None
                       else refresh.query_positions(request, options.refresh_options))
            reuse = self.planner.reuse_pass(request, plan, queries, observe)
            logits, capture = reuse.run(refresh, options.refresh_budget, options.refresh_options,
                                        options.trace_selection)
            self.planner.store_computed(plan, capture)
        reuse.stats.report(plan.stats)
        return _Prefilled(plan.seq, logits, plan.stats, capture)

    def _compress(self, request: Request, prefilled: _Prefilled, options: GenerationOptions) -> Recompressor | None:
        """Keeps ``options.keep`` of the prompt's KV per layer, when a compression policy is asked for."""
        compression = options.compression_policy()
        if compression is None:
            return None

        def draft(n_steps: int) -> tuple[dict[int, torch.Tensor], list[int]]:
            """Decode steps over the whole prompt's KV, for the policies that score with them."""
            return self.decoder.draft_queries(prefilled.seq, prefilled.logits, request.n_tokens, request.next_rope,
                                              n_steps)

        return compress_prompt(compression, options.keep, options.compress_options, prefilled.seq, self.model.config,
                               prefilled.capture.queries, compression.query_rows(request), prefilled.stats,
                               options.trace_selection, model_group(self.model), draft)


# Runtimes not closed yet. At interpreter exit they are closed while every module is still whole;
# left to the final garbage collection, a stream's cleanup could run after its arena was freed.
_OPEN_RUNTIMES: "weakref.WeakSet[Runtime]" = weakref.WeakSet()


@atexit.register
def _close_open_runtimes() -> None:
    for runtime in list(_OPEN_RUNTIMES):
        try:
            runtime.close()
        except Exception:  # noqa: BLE001 (exiting anyway: close the others)
            logger.exception("closing a Runtime at exit failed")


def _kv_bytes(model, dtype: torch.dtype, device: torch.device) -> int:
    """The default KV arena: room for DEFAULT_CONTEXT_TOKENS tokens, at most half the free GPU memory."""
    c = model.config
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.tensor([], dtype=dtype).element_size()
    want = per_token * DEFAULT_CONTEXT_TOKENS
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        want = min(want, free // 2)
    return want
