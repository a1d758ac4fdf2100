"""The image-KV store on disk (``Runtime(cache_dir=...)``): image entries that outlive the process.

One file per image and model, ``<model id>-<image key>.safetensors`` in the cache folder, holding
the entry as the in-memory stores keep it:

- ``k``, ``v``: pre-RoPE K and V of every decoder layer, model dtype [n_layers, n_tokens,
  n_kv_heads, head_dim];
- ``value_norms``: float32 [n_layers, n_tokens] (CONDUIT's scores weight attention by them);
- ``embedding`` (when the embedding cache held it): the projected image features, model dtype
  [n_tokens, hidden], where CONDUIT's recompute starts;
- metadata: the format, the 32-byte image key, the model's identity (``model_fingerprint``), the
  dtype and shapes, and a blake2b checksum over the metadata and every tensor's bytes.

A file is used only when all of that matches what the loading model expects; any other file
(corrupted, truncated, empty, another model's, another dtype's, other shapes, another key) is a
miss: it is deleted with a warning, and the image is computed again.

Several processes may share one folder. Writes go to a temporary file in the folder, fsynced, then
``os.replace``d onto the name, so a reader sees a whole file or none; readers take files vanishing
under them as misses. The LRU byte budget is kept by sweeps that hold a lock file (``filelock``):
a hit touches the file's mtime, and a sweep deletes the least recently touched files until the
folder's ``*.safetensors`` files (every model's) fit ``max_bytes``.

Writes run on one background thread per store, off the request's path: ``save`` takes the
tensors as the request left them (on the model's device) and queues them, up to
``MAX_PENDING_BYTES``; past that a save is dropped (caching is an optimisation). ``close`` (a
Runtime's close, or interpreter exit) writes what is queued and stops the thread.

Longer than most files (~450 lines): the file format, the writer thread and the LRU sweeps share
the folder's naming, lock and counts, and are one owner's; each is a screen or less.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import filelock
import safetensors
import safetensors.torch
import torch

from .errors import InvalidArgumentError

logger = logging.getLogger(__name__)

FORMAT = "conduit-image-kv/1"
SUFFIX = ".safetensors"
LOCK_NAME = ".conduit-image-kv.lock"
DEFAULT_CACHE_DIR_BYTES = 4 << 30
# Device memory the queued writes may hold before a save is dropped.
MAX_PENDING_BYTES = 512 << 20
# A temporary file this old belongs to a writer that died: a sweep deletes it.
STALE_TEMP_S = 3600.0
# Bytes of a tensor hashed as one piece of the checksum (the pieces are hashed in parallel).
CHECKSUM_CHUNK = 8 << 20
# Elements of each weight tensor that ``model_fingerprint`` reads.
FINGERPRINT_SAMPLES = 256


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
    """An image entry read from disk, on the CPU: K, V [n_layers, n_tokens, n_kv_heads, head_dim]
    (model dtype), value norms float32 [n_layers, n_tokens], embedding [n_tokens, hidden] or None."""

    k: torch.Tensor
    v: torch.Tensor
    value_norms: torch.Tensor
    embedding: torch.Tensor | None

    @property
    def n_tokens(self) -> int:
        return int(self.k.shape[1])


@dataclass(frozen=True, slots=True)
class DiskCacheStats:
    """Counts of one store since it opened, and the folder as its last sweep found it.

    ``hits``: loads that gave an entry; ``misses``: lookups that did not (``rejected`` of them found
    an unusable file and deleted it); ``writes``: files written; ``dropped_writes``: saves dropped
    (queue full, or an entry larger than the budget); ``evictions``: files the LRU sweeps deleted;
    ``bytes``, ``files``: the folder's entries of every model; ``pending_writes``: saves queued."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    writes: int = 0
    dropped_writes: int = 0
    evictions: int = 0
    bytes: int = 0
    files: int = 0
    pending_writes: int = 0
    max_bytes: int = 0


class _Unusable(Exception):
    """A file that is not a valid entry for this model and key (the message says why)."""


def prepare_directory(path, what: str = "cache_dir") -> Path:
    """``path`` as a folder this process can write files into, created if missing; otherwise
    InvalidArgumentError saying what is wrong with it."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidArgumentError(f"{what} must be a folder path (str or Path), got {path!r}")
    directory = Path(path).expanduser()
    if directory.exists() and not directory.is_dir():
        raise InvalidArgumentError(f"{what} {str(directory)!r} is a file, not a folder: give a folder path")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        reason = error.strerror or error
        raise InvalidArgumentError(f"{what} {str(directory)!r} cannot be created or written ({reason}): "
                                   "give a folder this process may write to") from error
    return directory


def model_fingerprint(model) -> str:
    """The identity of a model's KV (hex): its class, config, dtype, vision identity, and every
    weight's name, shape, dtype and ``FINGERPRINT_SAMPLES`` evenly strided values. Two models with
    equal fingerprints compute the same KV; a converted file converted again from other weights, or
    loaded in another dtype, gets another. Reads a few KiB of each weight (one device transfer)."""
    digest = hashlib.blake2b(digest_size=16)
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
    and the blake2b of each ``CHECKSUM_CHUNK`` bytes of it. The chunks are hashed on a thread pool
    (hashlib lets the GIL go): a 7B model's image entry is ~300 MB, checked on every load."""
    chunks = []
    for name in sorted(tensors):
        data = memoryview(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
        chunks += [(name, data[i: i + CHECKSUM_CHUNK]) for i in range(0, max(len(data), 1), CHECKSUM_CHUNK)]
    digests = _chunk_digests([data for _, data in chunks])
    digest = hashlib.blake2b(digest_size=32)
    digest.update(json.dumps({k: v for k, v in metadata.items() if k != "checksum"}, sort_keys=True).encode())
    for (name, _), chunk_digest in zip(chunks, digests):
        digest.update(name.encode() + chunk_digest)
    return digest.hexdigest()


def _chunk_digests(chunks: list[memoryview]) -> list[bytes]:
    """blake2b of each chunk: on the pool, or here when there is one chunk or the pool is shut down
    (at interpreter exit, when the last queued saves are written)."""
    if len(chunks) > 1:
        try:
            return list(_hash_pool().map(_chunk_digest, chunks))
        except RuntimeError:
            pass
    return [_chunk_digest(chunk) for chunk in chunks]


def _chunk_digest(chunk: memoryview) -> bytes:
    return hashlib.blake2b(chunk, digest_size=32).digest()


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    """The threads that hash checksum chunks (one pool per process)."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="conduit-checksum")


# A forked child inherits the cached pool without its threads: it makes its own.
os.register_at_fork(after_in_child=_hash_pool.cache_clear)


@dataclass(slots=True)
class _Save:
    """A queued save: the tensors as the request left them, and the device event after which they
    are whole (None on the CPU)."""

    key: bytes
    tensors: dict[str, torch.Tensor]
    ready: object
    nbytes: int


class DiskImageStore:
    """Image entries of one model (``model_id``, ``layout``) in ``directory``, LRU under ``max_bytes``.

    ``load`` and ``save`` may be called from any thread; the writes run on the store's own thread.
    """

    def __init__(self, directory: str | Path, max_bytes: int, model_id: str, layout: EntryLayout) -> None:
        self.directory = prepare_directory(directory)
        self.max_bytes, self.model_id, self.layout = int(max_bytes), model_id, layout
        self._lock = threading.Condition()
        self._counts = dict.fromkeys(("hits", "misses", "rejected", "writes", "dropped_writes", "evictions",
                                      "bytes", "files"), 0)
        self._queue: deque[_Save] = deque()
        self._pending_bytes = 0
        self._writing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._sweep()
        _OPEN_STORES.add(self)

    # -- lookups --------------------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        return self.directory / f"{self.model_id[:16]}-{key.hex()}{SUFFIX}"

    def contains(self, key: bytes) -> bool:
        """Whether a file exists under ``key`` (not checked; not counted as a use)."""
        return self.path(key).is_file()

    def load(self, key: bytes, n_tokens: int | None = None) -> DiskEntry | None:
        """The entry under ``key`` (of ``n_tokens`` tokens, when given), touched as most recently used;
        None when there is no file, or when the file is unusable (then it is deleted)."""
        path = self.path(key)
        try:
            seen = path.stat()
        except OSError:  # never written, or evicted (by any process)
            self._count("misses")
            return None
        try:
            entry = self._read(path, key, n_tokens)
        except FileNotFoundError:  # evicted by another process between the two calls
            self._count("misses")
            return None
        except Exception as error:  # noqa: BLE001 (whatever is wrong with the file, it is a miss)
            logger.warning("image-KV cache file %s is unusable (%s): deleted", path, error)
            self._delete_if_unchanged(path, seen)
            self._count("misses", "rejected")
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: the entry read is whole all the same
        self._count("hits")
        return entry

    def _read(self, path: Path, key: bytes, n_tokens: int | None) -> DiskEntry:
        """The file's entry, checked against this model, ``key`` and ``n_tokens``; _Unusable (or the
        library's error) otherwise."""
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            expected = self._metadata(key, int(metadata.get("n_tokens", "0")))
            for field, value in expected.items():
                if metadata.get(field) != value:
                    raise _Unusable(f"{field} is {metadata.get(field)!r}, expected {value!r}")
            n = int(expected["n_tokens"])
            if n <= 0 or (n_tokens is not None and n != n_tokens):
                raise _Unusable(f"{n} tokens, expected {n_tokens}")
            shapes = self._shapes(n)
            names = set(f.keys())
            if not set(shapes) - {"embedding"} <= names <= set(shapes):
                raise _Unusable(f"tensors {sorted(names)}, expected {sorted(shapes)}")
            for name in names:
                if list(f.get_slice(name).get_shape()) != shapes[name]:
                    raise _Unusable(f"{name} has shape {f.get_slice(name).get_shape()}, expected {shapes[name]}")
            tensors = {name: f.get_tensor(name) for name in names}
        for name, tensor in tensors.items():
            want = torch.float32 if name == "value_norms" else self.layout.dtype
            if tensor.dtype != want:
                raise _Unusable(f"{name} has dtype {tensor.dtype}, expected {want}")
        if metadata.get("checksum") != checksum(tensors, metadata):
            raise _Unusable("checksum mismatch")
        return DiskEntry(tensors["k"], tensors["v"], tensors["value_norms"], tensors.get("embedding"))

    def _metadata(self, key: bytes, n_tokens: int) -> dict[str, str]:
        """The metadata every file of this model and key carries (but the checksum)."""
        a = self.layout
        return {"format": FORMAT, "key": key.hex(), "model": self.model_id, "dtype": str(a.dtype),
                "n_tokens": str(n_tokens), "n_layers": str(a.n_layers), "n_kv_heads": str(a.n_kv_heads),
                "head_dim": str(a.head_dim), "hidden": str(a.hidden)}

    def _shapes(self, n_tokens: int) -> dict[str, list[int]]:
        a = self.layout
        kv = [a.n_layers, n_tokens, a.n_kv_heads, a.head_dim]
        return {"k": kv, "v": kv, "value_norms": [a.n_layers, n_tokens], "embedding": [n_tokens, a.hidden]}

    # -- saves ------------------------------------------------------------------------------------------
    def save(self, key: bytes, k: list[torch.Tensor], v: list[torch.Tensor], value_norms: torch.Tensor,
             embedding: torch.Tensor | None) -> bool:
        """Queues an entry to be written: per layer K (before RoPE) and V [n_tokens, n_kv_heads,
        head_dim], value norms float32 [n_layers, n_tokens], the embedding [n_tokens, hidden] or
        None. Returns False (nothing queued) when the file exists, the store is closed or the queue
        is full."""
        if self._closed or self.contains(key):
            return False
        tensors = {"k": torch.stack(k), "v": torch.stack(v), "value_norms": value_norms.float().clone()}
        if embedding is not None:
            tensors["embedding"] = embedding.clone()
        ready = None
        if tensors["k"].device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensors["k"].device))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            if self._pending_bytes + nbytes > MAX_PENDING_BYTES or self._closed:
                self._counts["dropped_writes"] += 1
                return False
            self._queue.append(_Save(key, tensors, ready, nbytes))
            self._pending_bytes += nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_queued, name="conduit-image-kv-writer",
                                                daemon=True)
                self._thread.start()
            self._lock.notify_all()
        return True

    def flush(self) -> None:
        """Waits until every queued save is written (or dropped)."""
        with self._lock:
            while self._queue or self._writing:
                self._lock.wait()

    def close(self) -> None:
        """Writes what is queued, then stops the writer; later saves are refused. Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        _OPEN_STORES.discard(self)

    def _write_queued(self) -> None:
        """The writer thread: writes queued saves until the store closes and the queue is empty."""
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._writing = True
            try:
                self._write(job)
            except Exception as error:  # noqa: BLE001 (a failed write loses a cache entry, nothing more)
                logger.warning("image-KV cache: writing %s failed (%s)", self.path(job.key), error)
            finally:
                with self._lock:
                    self._writing = False
                    self._pending_bytes -= job.nbytes
                    self._lock.notify_all()

    def _write(self, job: _Save) -> None:
        path = self.path(job.key)
        if path.is_file():  # another process wrote it meanwhile
            return
        tensors = _on_host(job.tensors, job.ready)
        metadata = self._metadata(job.key, int(tensors["k"].shape[1]))
        metadata["checksum"] = checksum(tensors, metadata)
        payload = safetensors.torch.save(tensors, metadata)
        if len(payload) > self.max_bytes:
            self._count("dropped_writes")
            return
        _write_atomically(path, payload)
        self._count("writes")
        self._sweep()

    # -- the LRU budget ---------------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Deletes the least recently used files until the folder fits ``max_bytes``, and dead
        writers' temporary files; records the folder's size. Holds the folder's lock file (skipped
        when another process holds it for long: its sweep does the same work)."""
        try:
            with filelock.FileLock(str(self.directory / LOCK_NAME), timeout=10):
                files = self._entries()
                total = sum(size for _, size, _ in files)
                evicted = 0
                for path, size, _ in sorted(files, key=lambda item: item[2]):
                    if total <= self.max_bytes:
                        break
                    try:
                        path.unlink()
                        evicted += 1
                    except FileNotFoundError:
                        pass
                    total -= size
        except filelock.Timeout:
            return
        with self._lock:
            self._counts["evictions"] += evicted
            self._counts["bytes"], self._counts["files"] = total, len(files) - evicted

    def _entries(self) -> list[tuple[Path, int, int]]:
        """(path, size, mtime_ns) of the folder's entry files; deletes stale temporary files."""
        found, now = [], time.time()
        for item in os.scandir(self.directory):
            try:
                stat = item.stat()
                if item.name.endswith(SUFFIX) and item.is_file():
                    found.append((Path(item.path), stat.st_size, stat.st_mtime_ns))
                elif item.name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_S:
                    os.unlink(item.path)
            except FileNotFoundError:
                continue  # removed by another process while we looked
        return found

    # -- bookkeeping -------------------------------------------------------------------------------------
    def stats(self) -> DiskCacheStats:
        with self._lock:
            return DiskCacheStats(**self._counts, pending_writes=len(self._queue) + self._writing,
                                  max_bytes=self.max_bytes)

    def _count(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self._counts[name] += 1

    @staticmethod
    def _delete_if_unchanged(path: Path, seen: os.stat_result) -> None:
        """Deletes ``path`` unless another process replaced it since ``seen`` was taken."""
        try:
            now = path.stat()
            if (now.st_ino, now.st_mtime_ns, now.st_size) == (seen.st_ino, seen.st_mtime_ns, seen.st_size):
                path.unlink()
        except FileNotFoundError:
            pass


def _on_host(tensors: dict[str, torch.Tensor], ready) -> dict[str, torch.Tensor]:
    """CPU copies of a save's tensors. On CUDA: after ``ready`` (the event recorded when the save was
    queued), copied on a side stream so the copies overlap the request's kernels instead of
    queueing among them."""
    if ready is None:
        return tensors
    device = next(iter(tensors.values())).device
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        side.wait_event(ready)
        host = {}
        for name, tensor in tensors.items():
            tensor.record_stream(side)
            host[name] = tensor.to("cpu", non_blocking=False)
    return host


def _write_atomically(path: Path, payload: bytes) -> None:
    """Writes ``payload`` to a temporary file beside ``path``, fsyncs it, and renames it onto ``path``."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # readable by the other users of a shared folder, as a plain file would be
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise


# Stores not closed yet: at interpreter exit their queued saves are written before the writer
# threads (daemons) stop.
_OPEN_STORES: "weakref.WeakSet[DiskImageStore]" = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    for store in list(_OPEN_STORES):
        try:
            store.close()
        except Exception:  # noqa: BLE001 (exiting anyway: close the others)
            logger.exception("closing an image-KV cache folder at exit failed")
