"""A Pythonic layer over the native KV arena: ``KVArena``, ``Sequence``, ``ImageEntry``, ``DecodeStep``.

Tensors go in and out as torch tensors on the arena's device (CPU, or the CUDA device it was made
on) and in its dtype; every kernel is enqueued on torch's current CUDA stream. Shapes:

- K, V of tokens: ``[n, n_kv_heads, head_dim]``, arena dtype, contiguous.
- queries and attention output: ``[n_q, n_heads, head_dim]``, arena dtype; log-sum-exp
  ``[n_q, n_heads]`` float32.
- RoPE positions: int32 ``[n]`` (rotate-half RoPE) or ``[3, n]`` (M-RoPE) on the arena's device.
- causal positions, slots: Python ints or int tensors (any device; they are metadata).

Every failure raises a typed ``conduit_rt.errors`` exception and leaves the objects usable.

Lifetime: the library allows one thread at a time per arena (conduit.h). A sequence, step or image
entry keeps its arena alive and is unusable once the arena is closed; its finalizer frees it only
while the arena is open, and only under the arena's ``lock`` (taken without waiting: when another
thread holds it, the handle is left for ``free_deferred``), since the garbage collector runs
finalizers on whichever thread it interrupts.

The file is longer than most (~700 lines) because the four handle types share that lifetime rule
(``_Child``), the argument conversion to the C ABI and the status checks; each class is one screen
or two of thin wrappers over ``conduit.h``.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

import numpy as np
import torch

from . import native
from .errors import InvalidArgumentError

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KV_FORMATS = {"dense": 0, "fp8": 1}  # conduit_kv_format: K and V in the arena dtype, or e4m3 with row scales
ROPE_TYPES = {"none": 0, "neox": 1, "mrope": 2}


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """Exact block and byte counts of an arena (see ``conduit_arena_stats`` in conduit.h)."""

    n_blocks_total: int
    n_blocks_free: int
    n_blocks_used: int
    n_blocks_shared: int
    n_blocks_image: int
    n_seqs: int
    n_image_entries: int
    n_image_evictions: int
    block_bytes: int
    bytes_total: int
    bytes_used: int
    image_bytes: int


@dataclass(frozen=True, slots=True)
class KernelTuning:
    """Launch choices of the CUDA kernels (``conduit_tuning`` in conduit.h), for a GPU where a default
    is not the fastest: measure first (``tools/bench_prefill_attention.py``). 0 keeps a field's
    default; the CPU backend ignores them; results are the same up to float rounding. Both shape
    the many-query tensor-core attention (bf16/f16, head_dim 64 or 128).

    Attributes:
        mma_warps: warps per CTA, 4 or 8 (0: 8 while 8-warp CTAs fill every SM twice, else 4).
        mma_split_waves: waves of resident CTAs that its key splits fill when its unsplit CTAs leave
            SMs idle, 1..8 (0: 1).
    """

    mma_warps: int = 0
    mma_split_waves: int = 0

    def __post_init__(self) -> None:
        for name in ("mma_warps", "mma_split_waves"):  # (the ranges are the library's to check)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not -(2**31) <= value < 2**31:
                raise InvalidArgumentError(f"tuning.{name} must be an int32, got {value!r}")


# torch's current CUDA stream of a device index as an int, without a Stream object (a private
# binding that torch's own generated code calls; absent in a CPU-only build)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _int32_host(values: Iterable[int] | torch.Tensor, what: str):
    """A cffi int32 array (and its length) from ints or an integer tensor on any device.

    Vectorised (numpy): a forward pass hands every layer its slot list, hundreds of ints each time;
    contiguous int32 values are not copied (``ForwardBatch.slots`` is such an array, converted once
    for every layer).
    """
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dim() != 1:
            raise InvalidArgumentError(f"{what} must be a 1-D integer tensor, got {values.dtype} {list(values.shape)}")
        array = values.detach().cpu().numpy()
    else:
        values = values if isinstance(values, (list, tuple, np.ndarray)) else list(values)
        array = np.asarray(values)
        if array.size and array.dtype.kind not in "iub":  # ints given as other objects (numpy or torch scalars)
            array = np.asarray([int(v) for v in values], dtype=np.int64)
        if array.ndim != 1:
            raise InvalidArgumentError(f"{what} must be a flat list of ints")
    if array.size == 0:
        return native.ffi().NULL, 0
    if array.dtype != np.int32 and (int(array.min()) < -(2**31) or int(array.max()) >= 2**31):  # before a cast
        raise InvalidArgumentError(f"{what} holds a value outside int32")
    narrow = np.ascontiguousarray(array, dtype=np.int32)  # the same array when it is int32 already
    return native.ffi().from_buffer("int32_t[]", narrow), int(narrow.size)  # the cdata keeps `narrow` alive


class KVArena:
    """A fixed pool of KV blocks on one device, with its sequences and image-KV store.

    Args:
        n_layers, n_kv_heads, head_dim: the model's KV shape.
        dtype: torch.float32, torch.float16 or torch.bfloat16.
        device: "cpu" or a CUDA device.
        block_size: tokens per block (a power of two).
        kv_bytes: bytes of the pool (all of it is allocated now).
        image_cache_bytes: LRU byte budget of the image store, carved from the same pool.
        tuning: launch choices of the CUDA kernels (None: the library's defaults).
        kv_format: "dense" (K and V stored in ``dtype``) or "fp8" (e4m3 with a power-of-two scale per
            token and KV head: about half the bytes; every method still takes and returns ``dtype``).
    """

    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", block_size: int = 16, kv_bytes: int = 64 << 20,
                 image_cache_bytes: int = 0, tuning: KernelTuning | None = None, kv_format: str = "dense") -> None:
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"unsupported KV dtype {dtype}; use one of {list(DTYPES)}")
        if kv_format not in KV_FORMATS:
            raise InvalidArgumentError(f"unknown kv_format {kv_format!r}; use one of {list(KV_FORMATS)}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"unsupported device {self.device}; use cpu or cuda")
        self.dtype, self.kv_format = dtype, kv_format
        self._ffi, self._lib = native.load()
        params = self._lib.conduit_arena_default_params()
        params.backend = self._lib.CONDUIT_BACKEND_CUDA if self.device.type == "cuda" else self._lib.CONDUIT_BACKEND_CPU
        params.device = self.device.index or 0
        params.dtype = DTYPES[dtype]
        params.kv_format = KV_FORMATS[kv_format]
        params.n_layers, params.n_kv_heads, params.head_dim = n_layers, n_kv_heads, head_dim
        params.block_size, params.kv_bytes, params.image_cache_bytes = block_size, kv_bytes, image_cache_bytes
        if tuning is not None:
            params.tuning.mma_warps, params.tuning.mma_split_waves = tuning.mma_warps, tuning.mma_split_waves
        out = self._ffi.new("conduit_arena **")
        native.check(self._lib.conduit_arena_create(self._ffi.new("conduit_arena_params *", params), out),
                     "creating the KV arena")
        self._handle = out[0]
        self._children: weakref.WeakSet = weakref.WeakSet()
        # Held by whoever drives the arena from several threads (a Runtime holds it for each piece of
        # work); children finalized on another thread while it is held wait in ``_deferred``.
        self.lock = threading.RLock()
        self._deferred: list[tuple[object, object]] = []  # (the library's free function, handle)
        p = self._lib.conduit_arena_get_params(self._handle)
        self.n_layers, self.n_kv_heads, self.head_dim = p.n_layers, p.n_kv_heads, p.head_dim
        self.block_size, self.kv_bytes, self.image_cache_bytes = p.block_size, p.kv_bytes, p.image_cache_bytes
        self.tuning = KernelTuning(p.tuning.mma_warps, p.tuning.mma_split_waves)

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def handle(self):
        if self._handle is None:
            raise InvalidArgumentError("the arena is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Frees the pool, its sequences and image entries; their Python objects become unusable."""
        if self._handle is not None:
            for child in list(self._children):
                child._detach()
            self._deferred.clear()  # freed with the pool
            self._lib.conduit_arena_free(self._handle)
            self._handle = None

    def free_deferred(self) -> None:
        """Frees the children finalized on another thread while ``lock`` was held. Call it holding
        ``lock`` (a Runtime does whenever its work ends)."""
        while self._deferred:
            free, handle = self._deferred.pop()
            if self._handle is not None:
                free(handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "KVArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers used by sequences and entries ------------------------------------------------------
    def stream(self):
        """torch's current CUDA stream as a C pointer (NULL for the CPU backend). Every native call
        asks (a request makes ~130): torch's raw-stream query, which its compiled kernels use, builds
        no Stream object (~15 us less a call under cProfile); torch.cuda.current_stream where it is absent."""
        if self.device.type != "cuda":
            return self._ffi.NULL
        if _RAW_STREAM is not None:  # (the device has its index: __init__ resolves a bare "cuda")
            return self._ffi.cast("void *", _RAW_STREAM(self.device.index))
        return self._ffi.cast("void *", torch.cuda.current_stream(self.device).cuda_stream)

    def ptr(self, t: torch.Tensor | None, what: str, shape: Seq[int] | None = None, dtype: torch.dtype | None = None):
        """Checks a tensor's device, dtype, shape and contiguity; returns its data pointer."""
        if t is None:
            return self._ffi.NULL
        dtype = dtype or self.dtype
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise InvalidArgumentError(f"{what} is on {t.device}, the arena is on {self.device}")
        if t.dtype != dtype:
            raise InvalidArgumentError(f"{what} has dtype {t.dtype}, expected {dtype}")
        if shape is not None and list(t.shape) != list(shape):
            raise InvalidArgumentError(f"{what} has shape {list(t.shape)}, expected {list(shape)}")
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{what} must be contiguous")
        return self._ffi.cast("void *", t.data_ptr())

    def _adopt(self, child) -> None:
        self._children.add(child)

    # -- arena-wide operations -----------------------------------------------------------------------
    def set_rope(self, inv_freq: torch.Tensor | Seq[float], kind: str = "neox", sections: Seq[int] = (0, 0, 0),
                 attention_scaling: float = 1.0) -> None:
        """Sets the RoPE that ``rope_pos`` arguments use: ``inv_freq`` float32 [n_freq], kind
        "neox" (rotate-half) or "mrope" (with ``sections`` t, h, w summing to n_freq)."""
        if kind not in ROPE_TYPES:
            raise InvalidArgumentError(f"unknown RoPE kind {kind!r}; use one of {list(ROPE_TYPES)}")
        freqs = torch.as_tensor(inv_freq, dtype=torch.float32).detach().cpu().contiguous()
        keep = self._ffi.new("float[]", freqs.tolist())
        rope = self._ffi.new("conduit_rope_params *")
        rope.type, rope.n_freq, rope.inv_freq = ROPE_TYPES[kind], freqs.numel(), keep
        rope.sections = list(sections)
        rope.attention_scaling = float(attention_scaling)
        native.check(self._lib.conduit_arena_set_rope(self.handle, rope), "setting RoPE")

    def stats(self) -> ArenaStats:
        out = self._ffi.new("conduit_arena_stats *")
        native.check(self._lib.conduit_arena_get_stats(self.handle, out))
        return ArenaStats(**{f: int(getattr(out, f)) for f in ArenaStats.__dataclass_fields__})

    def new_sequence(self) -> "Sequence":
        out = self._ffi.new("conduit_seq **")
        native.check(self._lib.conduit_seq_create(self.handle, out), "creating a sequence")
        return Sequence(self, out[0])

    def new_step(self, max_seqs: int, max_tokens: int, n_heads: int) -> "DecodeStep":
        """A decode step for batches of up to ``max_seqs`` sequences of up to ``max_tokens`` tokens per
        layer, with queries of ``n_heads`` heads (see ``DecodeStep``)."""
        out = self._ffi.new("conduit_step **")
        native.check(self._lib.conduit_step_create(self.handle, max_seqs, max_tokens, n_heads, self.stream(), out),
                     "creating a decode step")
        return DecodeStep(self, out[0], max_seqs, max_tokens, n_heads)

    def create_image(self, key: bytes, n_tokens: int) -> "ImageEntry":
        """A pending image entry (write every layer, then ``commit``). Raises AlreadyExistsError,
        ArenaFullError."""
        out = self._ffi.new("conduit_image **")
        native.check(self._lib.conduit_image_create(self.handle, _key(key), n_tokens, out), "creating an image entry")
        return ImageEntry(self, out[0])

    def acquire_image(self, key: bytes) -> "ImageEntry | None":
        """A reference to the committed entry under ``key`` (marked most recently used), or None."""
        out = self._ffi.new("conduit_image **")
        status = self._lib.conduit_image_acquire(self.handle, _key(key), out)
        if status == self._lib.CONDUIT_ERR_NOT_FOUND:
            return None
        native.check(status, "looking up an image entry")
        return ImageEntry(self, out[0])

    def has_image(self, key: bytes) -> bool:
        """Whether a committed entry exists under ``key`` (not counted as a use)."""
        return bool(self._lib.conduit_image_contains(self.handle, _key(key)))

    def evict_image(self, key: bytes) -> None:
        native.check(self._lib.conduit_image_evict(self.handle, _key(key)), "evicting an image entry")


def _key(key: bytes):
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        raise InvalidArgumentError("an image key is 32 bytes (a sha256 digest)")
    return native.ffi().new("uint8_t[32]", bytes(key))


def _output_like(arena: KVArena, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The attention's output buffer: ``out`` checked to be a contiguous tensor of q's shape and
    dtype on the arena device, or a new one."""
    if out is None:
        return torch.empty_like(q)
    arena.ptr(out, "out", list(q.shape), q.dtype)
    return out


class _Child:
    """A native object owned by an arena; detached (unusable) once the arena is closed. ``_FREE`` names
    the library function that frees (or releases) it."""

    _FREE = ""

    def __init__(self, arena: KVArena, handle) -> None:
        self.arena = arena
        self._handle = handle
        self._lib = arena._lib
        self._ffi = arena._ffi
        arena._adopt(self)

    def _detach(self) -> None:
        self._handle = None

    @property
    def handle(self):
        # The arena's own check as well: when both were garbage in one cycle (the garbage collector
        # clears weak references before running finalizers, in any order) the arena may have been
        # freed without detaching this object.
        if self._handle is None or self.arena._handle is None:
            raise InvalidArgumentError(f"this {type(self).__name__} was freed (or its arena closed)")
        return self._handle

    def free(self) -> None:
        """Frees the native object; nothing when it is freed already or its arena is closed (freeing
        the arena freed it)."""
        handle, self._handle = self._handle, None
        if handle is not None and self.arena._handle is not None:
            getattr(self._lib, self._FREE)(handle)

    def __del__(self) -> None:
        try:
            self._finalize()
        except Exception:
            pass

    def _finalize(self) -> None:
        """Frees the object now when the arena's lock is free or this thread's, else leaves it to the
        lock's holder (``KVArena.free_deferred``); never waits: the thread holding the lock may be
        the one waiting for this thread."""
        arena, handle = self.arena, self._handle
        if handle is None or arena._handle is None:
            return
        if arena.lock.acquire(blocking=False):
            try:
                self.free()
                arena.free_deferred()
            finally:
                arena.lock.release()
        else:
            self._handle = None
            arena._deferred.append((getattr(self._lib, self._FREE), handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()


class Sequence(_Child):
    """One sequence's KV: per-layer block tables with a stored causal position per token."""

    _FREE = "conduit_seq_free"

    def n_tokens(self, layer: int = 0) -> int:
        n = self._lib.conduit_seq_n_tokens(self.handle, layer)
        if n < 0:
            raise InvalidArgumentError(f"layer {layer} out of range [0, {self.arena.n_layers})")
        return n

    def max_tokens(self) -> int:
        """Tokens of the longest layer (layers differ after compaction); one native call."""
        return int(self._lib.conduit_seq_max_tokens(self.handle))

    def positions(self, layer: int = 0) -> torch.Tensor:
        """Causal positions of the layer's tokens in slot order: int32 [n_tokens], on the CPU."""
        n = self.n_tokens(layer)
        out = torch.empty(n, dtype=torch.int32)
        native.check(self._lib.conduit_seq_get_positions(self.handle, layer, self._ffi.cast("int32_t *", out.data_ptr()), n))
        return out

    @property
    def nbytes(self) -> int:
        return int(self._lib.conduit_seq_bytes(self.handle))

    def append(self, positions: Iterable[int] | torch.Tensor) -> None:
        """Adds tokens with these causal positions to every layer (K, V to be written next)."""
        arr, n = _int32_host(positions, "positions")
        native.check(self._lib.conduit_seq_append(self.handle, arr, n), "appending tokens")

    def fork(self) -> "Sequence":
        """A copy-on-write copy sharing this sequence's full blocks."""
        out = self._ffi.new("conduit_seq **")
        native.check(self._lib.conduit_seq_fork(self.handle, self.arena.stream(), out), "forking a sequence")
        return Sequence(self.arena, out[0])

    def truncate(self, p0: int, p1: int = 2**31 - 1) -> None:
        """Removes the tokens whose position is in [p0, p1) from every layer."""
        native.check(self._lib.conduit_seq_truncate(self.handle, p0, p1, self.arena.stream()), "truncating")

    def compact(self, layer: int, keep_slots: Iterable[int] | torch.Tensor) -> None:
        """Keeps only these (strictly increasing) slots of one layer; frees emptied blocks."""
        arr, n = _int32_host(keep_slots, "keep_slots")
        native.check(self._lib.conduit_seq_compact(self.handle, layer, arr, n, self.arena.stream()), "compacting")

    def _kv_shape(self, n: int) -> list[int]:
        return [n, self.arena.n_kv_heads, self.arena.head_dim]

    def _rope_ptr(self, rope_pos: torch.Tensor | None, n: int):
        if rope_pos is None:
            return self._ffi.NULL
        shape = [n] if rope_pos.dim() == 1 else [3, n]
        return self.arena.ptr(rope_pos, "rope_pos", shape, torch.int32)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: Iterable[int] | torch.Tensor | None = None,
                 rope_pos: torch.Tensor | None = None) -> None:
        """Writes K, V [n, n_kv_heads, head_dim] into ``slots`` (default: the layer's last n), rotating
        K at ``rope_pos`` (int32 [n] or [3, n], arena device) when given."""
        n = int(k.shape[0]) if isinstance(k, torch.Tensor) and k.dim() > 0 else 0
        kp = self.arena.ptr(k, "k", self._kv_shape(n))
        vp = self.arena.ptr(v, "v", self._kv_shape(n))
        sp = self._ffi.NULL
        if slots is not None:
            sp, count = _int32_host(slots, "slots")
            if count != n:
                raise InvalidArgumentError(f"{count} slots given for {n} tokens")
        native.check(self._lib.conduit_seq_write_kv(self.handle, layer, n, kp, vp, sp, self._rope_ptr(rope_pos, n),
                                                    self.arena.stream()), "writing KV")

    def restore_image(self, layer: int, image: "ImageEntry", slots: Iterable[int] | torch.Tensor | None = None,
                      rope_pos: torch.Tensor | None = None) -> None:
        """Writes an image entry's layer into ``slots`` (default: the last n), K rotated at ``rope_pos``
        (the one-entry, one-layer case of ``restore_images``)."""
        self.restore_images([image], slots, rope_pos, layers=range(layer, layer + 1))

    def restore_images(self, images: Seq["ImageEntry"], slots: Iterable[int] | torch.Tensor | None = None,
                       rope_pos: torch.Tensor | None = None, layers: range | None = None) -> None:
        """Restores several image entries into every layer of ``layers`` (default: all) with one native
        call and one kernel launch. The entries' tokens are taken concatenated in the given order
        (n = the sum of their n_tokens) and go to ``slots`` (n ints, default: the last n) of each
        layer; K is rotated at ``rope_pos`` (int32 [n] or [3, n] on the arena device, concatenated
        alike), V copied as is."""
        layers = range(self.arena.n_layers) if layers is None else layers
        if not isinstance(layers, range) or layers.step != 1:
            raise InvalidArgumentError("layers must be a range with step 1")
        images = list(images)
        n = sum(image.n_tokens for image in images)
        handles = self._ffi.new("conduit_image *[]", [image.handle for image in images]) if images else self._ffi.NULL
        sp = self._ffi.NULL
        if slots is not None:
            sp, count = _int32_host(slots, "slots")
            if count != n:
                raise InvalidArgumentError(f"{count} slots given for {len(images)} image(s) of {n} tokens")
        native.check(self._lib.conduit_seq_restore_images(self.handle, layers.start, len(layers), len(images), handles,
                                                          sp, self._rope_ptr(rope_pos, n), self.arena.stream()),
                     "restoring image entries")

    def attention(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, scale: float,
                  return_lse: bool = False, out: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal-by-position attention of q [n_q, n_heads, head_dim] (positions q_pos int32 [n_q] on
        the arena device) over the layer. Returns out [n_q, n_heads, head_dim] (written into ``out``
        when given, a contiguous tensor of that shape) and, with return_lse, lse float32 [n_q,
        n_heads] natural log."""
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise InvalidArgumentError("q must be a [n_q, n_heads, head_dim] tensor")
        n_q, n_heads = int(q.shape[0]), int(q.shape[1])
        qp = self.arena.ptr(q, "q", [n_q, n_heads, self.arena.head_dim])
        pp = self.arena.ptr(q_pos, "q_pos", [n_q], torch.int32)
        out = _output_like(self.arena, q, out)
        lse = torch.empty(n_q, n_heads, dtype=torch.float32, device=q.device) if return_lse else None
        native.check(self._lib.conduit_seq_attention(
            self.handle, layer, n_q, n_heads, qp, self._ffi.cast("int32_t *", pp), float(scale),
            self._ffi.cast("void *", out.data_ptr()),
            self._ffi.cast("float *", lse.data_ptr()) if lse is not None else self._ffi.NULL,
            self.arena.stream()), "attention")
        return (out, lse) if return_lse else out

    def write_kv_attention(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                           slots: Iterable[int] | torch.Tensor | None, rope_pos: torch.Tensor | None,
                           q: torch.Tensor, q_pos: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``write_kv`` then ``attention``: a decoder layer's two arena calls (a ``DecodeStep`` makes
        them one kernel)."""
        self.write_kv(layer, k, v, slots, rope_pos=rope_pos)
        return self.attention(layer, q, q_pos, scale, return_lse=return_lse, out=out)

    def attention_stats(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, scale: float,
                        threshold: float = 0.01) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention statistics of q [n_q, n_heads, head_dim] over the layer, in one native pass.

        Returns (mass float32 [n_tokens]: the softmax probability each slot receives, summed over
        queries and heads; n_below float32 [n_heads]: visible (query, key) pairs whose probability is
        under ``threshold`` x the row's max; lse float32 [n_q, n_heads]).
        """
        n_q, n_heads = self._stats_shape(q)
        mass = torch.empty(self.n_tokens(layer), dtype=torch.float32, device=q.device)
        n_below = torch.empty(n_heads, dtype=torch.float32, device=q.device)
        lse = torch.empty(n_q, n_heads, dtype=torch.float32, device=q.device)
        self._stats(layer, q, n_q, n_heads, q_pos, scale, threshold, mass, n_below, lse)
        return mass, n_below, lse

    def attention_mass(self, layers: Seq[int], q: torch.Tensor, q_pos: torch.Tensor, lse: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """CONDUIT's scoring over several layers in one native call, each query row's log-sum-exp
        known: the mass of ``attention_stats`` per layer, the keys read once (see
        conduit_seq_attention_mass). q [n_layers, n_q, n_heads, head_dim] (arena dtype), q_pos int32
        [n_q] and lse float32 [n_layers, n_q, n_heads] (natural log: ``attention(...,
        return_lse=True)`` of the same queries) on the arena device; every layer must hold as many
        tokens. Returns float32 [n_layers, n_tokens]."""
        layers = [int(layer) for layer in layers]
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or int(q.shape[0]) != len(layers):
            raise InvalidArgumentError(f"q must be a [{len(layers)}, n_q, n_heads, head_dim] tensor")
        n_q, n_heads = int(q.shape[1]), int(q.shape[2])
        qp = self.arena.ptr(q, "q", [len(layers), n_q, n_heads, self.arena.head_dim])
        pp = self.arena.ptr(q_pos, "q_pos", [n_q], torch.int32)
        lp = self.arena.ptr(lse, "lse", [len(layers), n_q, n_heads], torch.float32)
        n_tokens = self.n_tokens(layers[0]) if layers else 0
        mass = torch.empty(len(layers), n_tokens, dtype=torch.float32, device=self.arena.device)
        f = self._ffi
        native.check(self._lib.conduit_seq_attention_mass(
            self.handle, len(layers), f.new("int32_t[]", layers) if layers else f.NULL, n_q, n_heads, qp,
            f.cast("int32_t *", pp), float(scale), f.cast("float *", lp), f.cast("float *", mass.data_ptr()),
            self.arena.stream()), "attention mass")
        return mass

    def _stats_shape(self, q: torch.Tensor) -> tuple[int, int]:
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise InvalidArgumentError("q must be a [n_q, n_heads, head_dim] tensor")
        return int(q.shape[0]), int(q.shape[1])

    def _stats(self, layer: int, q: torch.Tensor, n_q: int, n_heads: int, q_pos: torch.Tensor, scale: float,
               threshold: float, mass: torch.Tensor, n_below: torch.Tensor | None, lse: torch.Tensor | None) -> None:
        qp = self.arena.ptr(q, "q", [n_q, n_heads, self.arena.head_dim])
        pp = self.arena.ptr(q_pos, "q_pos", [n_q], torch.int32)
        f = self._ffi
        floats = [f.cast("float *", t.data_ptr()) if t is not None else f.NULL for t in (mass, n_below, lse)]
        native.check(self._lib.conduit_seq_attention_stats(
            self.handle, layer, n_q, n_heads, qp, f.cast("int32_t *", pp), float(scale), float(threshold), *floats,
            self.arena.stream()), "attention statistics")

    def read_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V in slot order: [n_tokens, n_kv_heads, head_dim] each (K as stored)."""
        n = self.n_tokens(layer)
        k = torch.empty(self._kv_shape(n), dtype=self.arena.dtype, device=self.arena.device)
        v = torch.empty_like(k)
        native.check(self._lib.conduit_seq_read_kv(self.handle, layer, self._ffi.cast("void *", k.data_ptr()),
                                                   self._ffi.cast("void *", v.data_ptr()), self.arena.stream()))
        return k, v


class DecodeStep(_Child):
    """One new token for each sequence of a batch, with what the kernels read about the sequences
    (their lengths and block tables) at fixed device addresses: ``prepare`` updates it in place, and
    ``write_kv`` / ``attention`` only enqueue kernels that read it, so a CUDA graph that captured them
    replays correctly at every later step (see conduit.h, "Decode steps").

    The step offers the two calls a decoder layer makes on a ``Sequence``, so a model's forward runs
    over a step as it runs over one sequence. Row i of every tensor is sequence i of the last
    ``prepare``: K, V ``[n_seqs, n_kv_heads, head_dim]``, queries and output ``[n_seqs, n_heads,
    head_dim]``, RoPE positions int32 ``[n_seqs]`` or ``[3, n_seqs]``. A captured graph launches for
    the number of sequences prepared at capture: replay it only after a ``prepare`` of as many.
    """

    _FREE = "conduit_step_free"

    def __init__(self, arena: KVArena, handle, max_seqs: int, max_tokens: int, n_heads: int) -> None:
        super().__init__(arena, handle)
        self.max_seqs, self.max_tokens, self.n_heads = max_seqs, max_tokens, n_heads
        self.n_seqs = 0

    def _require_prepared(self) -> None:
        if self.n_seqs == 0:
            raise InvalidArgumentError("the decode step was not prepared (call prepare first)")

    def prepare(self, seqs: Seq[Sequence], positions: Iterable[int] | torch.Tensor) -> None:
        """Appends a token at ``positions[i]`` to every layer of ``seqs[i]`` and updates the step's
        device state. Each position must come after every stored one; on error nothing changed."""
        seqs = list(seqs)
        arr, n = _int32_host(positions, "positions")
        if n != len(seqs):
            raise InvalidArgumentError(f"{n} positions given for {len(seqs)} sequences")
        handles = self._ffi.new("conduit_seq *[]", [s.handle for s in seqs]) if seqs else self._ffi.NULL
        native.check(self._lib.conduit_step_prepare(self.handle, len(seqs), handles, arr, self.arena.stream()),
                     "preparing a decode step")
        self.n_seqs = len(seqs)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: None = None,
                 rope_pos: torch.Tensor | None = None) -> None:
        """Writes the new tokens' K, V [n_seqs, n_kv_heads, head_dim] into their slots, K rotated at
        ``rope_pos``. ``slots`` must be None: a step's tokens go to the slots ``prepare`` appended."""
        native.check(self._lib.conduit_step_write_kv(self.handle, layer, *self._kv_args(k, v, slots, rope_pos),
                                                     self.arena.stream()), "writing a decode step's KV")

    def attention(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor | None = None, scale: float = 1.0,
                  return_lse: bool = False, out: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [n_seqs, n_heads, head_dim] over every stored token of each query's own
        sequence (into ``out`` when given). ``q_pos`` is not read (a decode query comes after every
        stored token, as ``prepare`` checked); it is accepted so that a step stands in for a
        ``Sequence``."""
        qp, out, lse = self._attention_args(q, out, return_lse)
        native.check(self._lib.conduit_step_attention(self.handle, layer, qp, float(scale), *self._outputs(out, lse),
                                                      self.arena.stream()), "decode step attention")
        return (out, lse) if return_lse else out

    def write_kv_attention(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: None,
                           rope_pos: torch.Tensor | None, q: torch.Tensor, q_pos: torch.Tensor | None = None,
                           scale: float = 1.0, out: torch.Tensor | None = None, return_lse: bool = False
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``write_kv`` then ``attention`` (the same bits) in one native call, which on CUDA writes the
        new rows inside the attention kernel: one launch fewer per layer."""
        kv_args = self._kv_args(k, v, slots, rope_pos)
        qp, out, lse = self._attention_args(q, out, return_lse)
        native.check(self._lib.conduit_step_write_kv_attention(self.handle, layer, *kv_args, qp, float(scale),
                                                               *self._outputs(out, lse), self.arena.stream()),
                     "decode step KV write and attention")
        return (out, lse) if return_lse else out

    def _kv_args(self, k: torch.Tensor, v: torch.Tensor, slots: None, rope_pos: torch.Tensor | None) -> tuple:
        """(k, v, rope_pos) pointers of the new tokens, checked."""
        if slots is not None:
            raise InvalidArgumentError("a decode step writes the slots prepare appended; slots must be None")
        self._require_prepared()
        shape = [self.n_seqs, self.arena.n_kv_heads, self.arena.head_dim]
        rope = self._ffi.NULL
        if rope_pos is not None:
            rope = self.arena.ptr(rope_pos, "rope_pos", [self.n_seqs] if rope_pos.dim() == 1 else [3, self.n_seqs],
                                  torch.int32)
        return self.arena.ptr(k, "k", shape), self.arena.ptr(v, "v", shape), rope

    def _attention_args(self, q: torch.Tensor, out: torch.Tensor | None,
                        return_lse: bool) -> tuple[object, torch.Tensor, torch.Tensor | None]:
        """(q pointer, out, lse or None) of the step's queries, checked."""
        self._require_prepared()
        qp = self.arena.ptr(q, "q", [self.n_seqs, self.n_heads, self.arena.head_dim])
        out = _output_like(self.arena, q, out)
        lse = torch.empty(self.n_seqs, self.n_heads, dtype=torch.float32, device=q.device) if return_lse else None
        return qp, out, lse

    def _outputs(self, out: torch.Tensor, lse: torch.Tensor | None) -> tuple:
        """(out, lse or NULL) as the C calls take them."""
        return (self._ffi.cast("void *", out.data_ptr()),
                self._ffi.cast("float *", lse.data_ptr()) if lse is not None else self._ffi.NULL)


class ImageEntry(_Child):
    """A reference to an image-KV entry (pre-RoPE K and V of every layer). Release it when done."""

    _FREE = "conduit_image_release"

    def release(self) -> None:
        self.free()

    @property
    def n_tokens(self) -> int:
        return int(self._lib.conduit_image_n_tokens(self.handle))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = [self.n_tokens, self.arena.n_kv_heads, self.arena.head_dim]
        native.check(self._lib.conduit_image_write(self.handle, layer, self.arena.ptr(k, "k", shape),
                                                   self.arena.ptr(v, "v", shape), self.arena.stream()),
                     "writing an image entry")

    def commit(self) -> None:
        native.check(self._lib.conduit_image_commit(self.handle))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = [self.n_tokens, self.arena.n_kv_heads, self.arena.head_dim]
        k = torch.empty(shape, dtype=self.arena.dtype, device=self.arena.device)
        v = torch.empty_like(k)
        native.check(self._lib.conduit_image_read(self.handle, layer, self._ffi.cast("void *", k.data_ptr()),
                                                  self._ffi.cast("void *", v.data_ptr()), self.arena.stream()))
        return k, v
