"""One image entry as a file: its format, its checks, and the identity of the model it belongs to.

An entry file (safetensors) holds the entry as the in-memory stores keep it:

- ``k``, ``v``: pre-RoPE K and V of every decoder layer, model dtype [n_layers, n_tokens,
  n_kv_heads, head_dim];
- ``value_norms``: float32 [n_layers, n_tokens] (CONDUIT's scores weight attention by them);
- ``embedding`` (when the embedding cache held it): the projected image features, model dtype
  [n_tokens, hidden], where CONDUIT's recompute starts;
- metadata: the format, the 32-byte image key, the model's identity (``model_fingerprint``), the
  dtype and shapes, and a blake2b checksum over the metadata and every tensor's bytes.

Files are written by the safetensors library. They are read by ``EntryFormat.check`` (the header,
against what the loading model expects; ``UnusableEntryError`` otherwise) and ``read_entries``
(the tensor bytes of several files at once, straight into tensors on the model's device, and the
checksum); the store that owns the files is ``disk_cache.DiskImageStore``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import safetensors.torch
import torch

FORMAT = "conduit-image-kv/1"
# Bytes of a tensor hashed as one piece of the checksum (the pieces are hashed in parallel).
CHECKSUM_CHUNK = 8 << 20
# Elements of each weight tensor that ``model_fingerprint`` reads.
FINGERPRINT_SAMPLES = 256
# The longest header the safetensors library accepts; a longer length field is a damaged file.
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True, slots=True)
class EntryLayout:
    """What every entry of one model holds: its KV shape and dtype, and the embeddings' width."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """An image entry read from disk, on the device it was read to: K, V [n_layers, n_tokens,
    n_kv_heads, head_dim] (model dtype), value norms float32 [n_layers, n_tokens], embedding
    [n_tokens, hidden] or None."""

    k: torch.Tensor
    v: torch.Tensor
    value_norms: torch.Tensor
    embedding: torch.Tensor | None

    @property
    def n_tokens(self) -> int:
        return int(self.k.shape[1])


class UnusableEntryError(Exception):
    """A file that is not a valid entry for this model and key (the message says why). Never leaves
    the package: the store turns it into a miss."""


@dataclass(frozen=True, slots=True)
class TensorSpan:
    """One tensor of an entry file: its name, dtype, shape, and its bytes [start, stop) in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class EntryFile:
    """An open entry file whose header ``EntryFormat.check`` accepted: the descriptor (its owner
    closes it), its size in bytes, its metadata and its tensors in name order (the checksum's)."""

    fd: int
    size: int
    metadata: dict[str, str]
    spans: tuple[TensorSpan, ...]


@dataclass(frozen=True, slots=True)
class EntryFormat:
    """The entry files of one model (``model_id``: its ``model_fingerprint``): what they must say."""

    model_id: str
    layout: EntryLayout

    def metadata(self, key: bytes, n_tokens: int) -> dict[str, str]:
        """The metadata every file of this model and key carries (but the checksum)."""
        a = self.layout
        return {"format": FORMAT, "key": key.hex(), "model": self.model_id, "dtype": str(a.dtype),
                "n_tokens": str(n_tokens), "n_layers": str(a.n_layers), "n_kv_heads": str(a.n_kv_heads),
                "head_dim": str(a.head_dim), "hidden": str(a.hidden)}

    def shapes(self, n_tokens: int) -> dict[str, list[int]]:
        a = self.layout
        kv = [a.n_layers, n_tokens, a.n_kv_heads, a.head_dim]
        return {"k": kv, "v": kv, "value_norms": [a.n_layers, n_tokens], "embedding": [n_tokens, a.hidden]}

    def dtype_of(self, name: str) -> torch.dtype:
        return torch.float32 if name == "value_norms" else self.layout.dtype

    def encode(self, key: bytes, tensors: dict[str, torch.Tensor]) -> bytes:
        """The file of an entry: ``tensors`` (CPU; ``k``, ``v``, ``value_norms``, maybe ``embedding``)
        with their metadata and checksum."""
        metadata = self.metadata(key, int(tensors["k"].shape[1]))
        metadata["checksum"] = checksum(tensors, metadata)
        return safetensors.torch.save(tensors, metadata)

    def check(self, fd: int, key: bytes, n_tokens: int | None) -> EntryFile:
        """The open file ``fd`` as an entry of this model, ``key`` and ``n_tokens`` (when given),
        judged by its header alone (its bytes are checked by ``read_entries``); UnusableEntryError
        otherwise. Header and tensor bytes come from the one descriptor: a file another process
        renames over the name meanwhile does not mix into it."""
        size = os.fstat(fd).st_size
        header, data_start = _read_header(fd, size)
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise UnusableEntryError("the metadata is not a map of strings")
        expected = self.metadata(key, _int(metadata.get("n_tokens", "0")))
        for field, value in expected.items():
            if metadata.get(field) != value:
                raise UnusableEntryError(f"{field} is {metadata.get(field)!r}, expected {value!r}")
        n = int(expected["n_tokens"])
        if n <= 0 or (n_tokens is not None and n != n_tokens):
            raise UnusableEntryError(f"{n} tokens, expected {n_tokens}")
        shapes = self.shapes(n)
        if not set(shapes) - {"embedding"} <= set(header) <= set(shapes):
            raise UnusableEntryError(f"tensors {sorted(header)}, expected {sorted(shapes)}")
        spans = tuple(self._span(name, header[name], shapes[name], data_start) for name in sorted(header))
        _check_tiling(spans, data_start, size)
        return EntryFile(fd, size, metadata, spans)

    def _span(self, name: str, info: dict, shape: list[int], data_start: int) -> TensorSpan:
        """A tensor's header entry checked against its expected dtype and shape."""
        dtype = self.dtype_of(name)
        if info.get("dtype") != _dtype_name(dtype):
            raise UnusableEntryError(f"{name} has dtype {info.get('dtype')}, expected {_dtype_name(dtype)}")
        if info.get("shape") != shape:
            raise UnusableEntryError(f"{name} has shape {info.get('shape')}, expected {shape}")
        begin, end = info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise UnusableEntryError(f"{name} spans {end - begin} bytes, not {math.prod(shape) * dtype.itemsize}")
        return TensorSpan(name, dtype, tuple(shape), data_start + begin, data_start + end)


def read_entries(files: Sequence[EntryFile], device: torch.device | str = "cpu") -> list[DiskEntry | Exception]:
    """The entries of ``files`` (checked by ``EntryFormat.check``), read together, as tensors on
    ``device``; for a file whose bytes are short or fail the checksum, its error (UnusableEntryError,
    or the OSError of the read) instead.

    Every ``CHECKSUM_CHUNK`` piece of every file is one task on the checksum pool: read (``preadv``)
    straight into the tensor's bytes, or on CUDA into a pinned buffer that is copied to the device
    on a side stream while the task hashes it; the pieces of all files keep the pool's threads busy
    together. An entry is returned only once its checksum matched and (CUDA) its copies are done;
    the tensors of a file that failed are dropped, no one saw them."""
    device = torch.device(device)
    side = None
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the memory below may be freed work's
    targets = [{s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in f.spans} for f in files]
    pieces = _pieces(files, targets)
    try:
        digests = _on_pool(functools.partial(_read_piece, side=side), pieces)
    finally:
        if side is not None:
            side.synchronize()  # no copy still writes the tensors once they are returned or dropped
    return [_entry_or_error(f, t, [(p.name, d) for p, d in zip(pieces, digests) if p.file == index])
            for index, (f, t) in enumerate(zip(files, targets))]


@dataclass(frozen=True, slots=True)
class _Piece:
    """One checksum chunk of a file being read: its bytes from ``offset`` of ``fd`` go into ``target``
    (a uint8 view of its tensor); ``file`` is the file's index in the read, ``name`` the tensor's."""

    fd: int
    offset: int
    target: torch.Tensor
    file: int
    name: str


def _pieces(files: Sequence[EntryFile], targets: list[dict[str, torch.Tensor]]) -> list[_Piece]:
    """Every checksum chunk of every file, in checksum order within each file."""
    pieces = []
    for index, (f, tensors) in enumerate(zip(files, targets)):
        for span in f.spans:
            flat = tensors[span.name].view(-1).view(torch.uint8)
            pieces += [_Piece(f.fd, span.start + start, flat[start:stop], index, span.name)
                       for start, stop in chunk_bounds(span.nbytes)]
    return pieces


def _entry_or_error(f: EntryFile, tensors: dict[str, torch.Tensor],
                    digests: list[tuple[str, bytes | Exception]]) -> DiskEntry | Exception:
    """The entry read from ``f`` into ``tensors``, given each piece's (tensor name, blake2b or error
    of its read) in checksum order; the first error, or a mismatch, instead."""
    failed = next((digest for _, digest in digests if isinstance(digest, Exception)), None)
    if failed is not None:
        return failed
    if f.metadata.get("checksum") != _combine(f.metadata, digests):
        return UnusableEntryError("checksum mismatch")
    return DiskEntry(tensors["k"], tensors["v"], tensors["value_norms"], tensors.get("embedding"))


def _read_piece(piece: _Piece, side) -> bytes | Exception:
    """Reads a piece into its target (on CUDA through a pinned buffer, copied on the stream ``side``)
    and returns the blake2b of its bytes; the error instead when the read fails (judged with its file)."""
    try:
        if side is None:
            data = memoryview(piece.target.numpy())
            _read_exactly(piece.fd, data, piece.offset)
            return _chunk_digest(data)
        with torch.cuda.stream(side):  # (and its device: the pinned buffer is allocated for it)
            staging = torch.empty(piece.target.numel(), dtype=torch.uint8, pin_memory=True)
            data = memoryview(staging.numpy())
            _read_exactly(piece.fd, data, piece.offset)
            # torch's pinned-memory allocator keeps ``staging`` from reuse until this copy is done
            piece.target.copy_(staging, non_blocking=True)
        return _chunk_digest(data)  # while the copy runs
    except Exception as error:  # noqa: BLE001 (an unreadable piece makes its file a miss)
        return error


def _read_exactly(fd: int, data: memoryview, offset: int) -> None:
    """Fills ``data`` with the bytes of ``fd`` from ``offset`` (UnusableEntryError if the file ends)."""
    while len(data):
        n = os.preadv(fd, [data], offset)
        if n == 0:
            raise UnusableEntryError("the file ends before its tensors do")
        data, offset = data[n:], offset + n


def _read_header(fd: int, size: int) -> tuple[dict, int]:
    """The JSON header of the safetensors file ``fd`` of ``size`` bytes (8-byte little-endian length,
    then the JSON), and where the tensor data begins. The library parses headers only of paths and
    of whole files in memory, and tells no tensor's offsets: this parses the descriptor's own."""
    if size < 8:
        raise UnusableEntryError(f"{size} bytes, not a safetensors file")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise UnusableEntryError(f"a header of {length} bytes in a file of {size}")
    raw = os.pread(fd, length, 8)
    if len(raw) != length:
        raise UnusableEntryError("the file ends inside its header")
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise UnusableEntryError(f"the header is not JSON ({error})") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise UnusableEntryError("the header is not a map of tensors")
    for name, info in header.items():
        offsets = info.get("data_offsets")
        if name != "__metadata__" and not (isinstance(offsets, list) and len(offsets) == 2
                                           and all(type(x) is int and x >= 0 for x in offsets)
                                           and offsets[0] <= offsets[1]):
            raise UnusableEntryError(f"{name} has offsets {offsets!r}")
    return header, 8 + length


def _check_tiling(spans: Sequence[TensorSpan], data_start: int, size: int) -> None:
    """The tensors cover the file's data [data_start, size) exactly, without overlap (as safetensors
    requires of every file)."""
    position = data_start
    for span in sorted(spans, key=lambda s: s.start):
        if span.start != position:
            raise UnusableEntryError(f"{span.name} starts at byte {span.start}, expected {position}")
        position = span.stop
    if position != size:
        raise UnusableEntryError(f"the tensors end at byte {position}, the file at {size}")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UnusableEntryError(f"n_tokens is {text!r}") from None


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """The name safetensors writes for ``dtype`` in a header ("BF16", "F32", ...), asked of it."""
    saved = safetensors.torch.save({"t": torch.empty(0, dtype=dtype)})
    (length,) = struct.unpack("<Q", saved[:8])
    return json.loads(saved[8: 8 + length])["t"]["dtype"]


def model_fingerprint(model, kv_format: str = "dense") -> str:
    """The identity of a model's KV (hex): its class, config, dtype, vision identity, and every
    weight's name, shape, dtype and ``FINGERPRINT_SAMPLES`` evenly strided values. Two models with
    equal fingerprints compute the same KV; a converted file converted again from other weights, or
    loaded in another dtype, gets another. ``kv_format``: how the arena stores the KV ("fp8" entries
    hold e4m3-rounded values, another KV than a dense cache's). Reads a few KiB of each weight (one
    device transfer)."""
    digest = hashlib.blake2b(digest_size=16)
    if kv_format != "dense":
        digest.update(f"kv_format={kv_format};".encode())
    vision_id = getattr(getattr(model, "assets", None), "vision_model_id", "")
    digest.update(repr((type(model).__name__, model.config, str(model.dtype), vision_id)).encode())
    samples = []
    for name, weight in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype};".encode())
        flat = weight.detach().reshape(-1)
        if flat.numel():
            samples.append(flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES].float())
    if samples:
        digest.update(torch.cat(samples).cpu().numpy().tobytes())
    return digest.hexdigest()


def checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """blake2b (hex) over the metadata (but its checksum) and, in name order, each CPU tensor's name
    and the blake2b of each ``CHECKSUM_CHUNK`` bytes of it (``chunk_bounds``). The chunks are hashed
    on a thread pool (hashlib lets the GIL go): a 7B model's image entry is ~300 MB, checked on every
    load (there by ``read_entries``, which hashes the chunks as it reads them)."""
    chunks = []
    for name in sorted(tensors):
        data = memoryview(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
        chunks += [(name, data[start:stop]) for start, stop in chunk_bounds(len(data))]
    digests = _on_pool(_chunk_digest, [data for _, data in chunks])
    return _combine(metadata, [(name, digest) for (name, _), digest in zip(chunks, digests)])


def chunk_bounds(nbytes: int) -> list[tuple[int, int]]:
    """The [start, stop) of each checksum chunk of a tensor of ``nbytes`` bytes (one, empty, for none)."""
    return [(start, min(start + CHECKSUM_CHUNK, nbytes)) for start in range(0, max(nbytes, 1), CHECKSUM_CHUNK)]


def _combine(metadata: dict[str, str], digests: list[tuple[str, bytes]]) -> str:
    """The checksum from the metadata and each chunk's (tensor name, blake2b), in checksum order."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(json.dumps({k: v for k, v in metadata.items() if k != "checksum"}, sort_keys=True).encode())
    for name, chunk_digest in digests:
        digest.update(name.encode() + chunk_digest)
    return digest.hexdigest()


def _on_pool(task: Callable, items: list) -> list:
    """``task`` of each item, on the checksum pool; here when there is one item or the pool is shut
    down (at interpreter exit, when the last queued saves are written)."""
    if len(items) > 1:
        try:
            return list(_hash_pool().map(task, items))
        except RuntimeError:
            pass
    return [task(item) for item in items]


def _chunk_digest(chunk: memoryview) -> bytes:
    return hashlib.blake2b(chunk, digest_size=32).digest()


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    """The threads that read and hash checksum chunks (one pool per process), one per CPU this
    process may run on: hashing is the bound of a load (blake2b runs at about 1 GB/s a core), and
    the request waits for it."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ThreadPoolExecutor(max_workers=max(1, min(32, cpus or 1)), thread_name_prefix="conduit-checksum")


# A forked child inherits the cached pool without its threads: it makes its own.
os.register_at_fork(after_in_child=_hash_pool.cache_clear)
