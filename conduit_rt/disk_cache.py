"""The image-KV store on disk (``Runtime(cache_dir=...)``): image entries that outlive the process.

One file per image and model, ``<model id>-<image key>.safetensors`` in the cache folder, in the
format of ``disk_entry`` (KV, value norms, embedding, the model's identity and a checksum). A file
is used only when it is whole and this model's; any other file (corrupted, truncated, empty,
another model's, another dtype's, other shapes, another key) is a miss: it is deleted with a
warning, and the image is computed again.

Several processes may share one folder. Writes go to a temporary file in the folder, fsynced, then
``os.replace``d onto the name, so a reader sees a whole file or none; readers take files vanishing
under them as misses. The LRU byte budget is kept by sweeps that hold a lock file (``filelock``):
a hit touches the file's mtime, and a sweep deletes the least recently touched files until the
folder's ``*.safetensors`` files (every model's) fit ``max_bytes``.

Reads take a file's header and bytes through one open descriptor (a file renamed over the name
meanwhile never mixes into the one being read), straight into tensors on the model's device, and
give an entry out only once its checksum matched (``disk_entry.read_entries``). ``load_many`` reads
the files of several keys (a request's images) together, their pieces spread over one thread pool.

Writes run on one background thread per store, off the request's path: ``save`` takes the
tensors as the request left them (on the model's device) and queues them. The queue holds
``MAX_PENDING_BYTES``, or ``MIN_PENDING_ENTRIES`` entries when entries are larger than an eighth of
that (a 7B-class model's image is about 300 MB: a request with several new images must not lose all
but the first); past that a save is dropped (caching is an optimisation). ``close`` (a
Runtime's close, or interpreter exit) writes what is queued and stops the thread.
"""
from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import filelock
import torch

from .disk_entry import DiskEntry, EntryFile, EntryFormat, EntryLayout, read_entries
from .errors import InvalidArgumentError

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
LOCK_NAME = ".conduit-image-kv.lock"
DEFAULT_CACHE_DIR_BYTES = 4 << 30
# Device memory the queued writes may hold before a save is dropped, unless it is less than
# MIN_PENDING_ENTRIES entries of the size being saved (the images of one request).
MAX_PENDING_BYTES = 512 << 20
MIN_PENDING_ENTRIES = 8
# A temporary file this old belongs to a writer that died: a sweep deletes it.
STALE_TEMP_S = 3600.0
# Bytes of files read at once by ``load_many`` (at least one file): the entries read together are on
# the device together, until the caller has taken them (a request's 7B-class images, ~300 MB each).
MAX_LOADING_BYTES = 1 << 30

T = TypeVar("T")


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
        self.max_bytes, self.format = int(max_bytes), EntryFormat(model_id, layout)
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
        return self.directory / f"{self.format.model_id[:16]}-{key.hex()}{SUFFIX}"

    def contains(self, key: bytes) -> bool:
        """Whether a file exists under ``key`` (not checked; not counted as a use)."""
        return self.path(key).is_file()

    def load(self, key: bytes, n_tokens: int | None = None, device: torch.device | str = "cpu") -> DiskEntry | None:
        """The entry under ``key`` (of ``n_tokens`` tokens, when given) on ``device``, touched as most
        recently used; None when there is no file, or when the file is unusable (then it is deleted)."""
        return dict(self.load_many({key: n_tokens}, device))[key]

    def load_many(self, wanted: dict[bytes, int | None],
                  device: torch.device | str = "cpu") -> Iterator[tuple[bytes, DiskEntry | None]]:
        """(key, entry or None) for each key of ``wanted`` (key -> n_tokens, or None for any), as
        ``load`` gives them one by one, but the files read together (``disk_entry.read_entries``:
        their pieces share the checksum threads), ``MAX_LOADING_BYTES`` of files at a time so that
        the device holds no more than that before the caller takes the entries of a group."""
        opened: list[tuple[bytes, Path, os.stat_result, EntryFile]] = []
        try:
            for key, n_tokens in wanted.items():
                found = self._open(key, n_tokens)
                if found is None:
                    yield key, None
                else:
                    opened.append((key, *found))
            for group in _groups(opened, lambda item: item[3].size, MAX_LOADING_BYTES):
                read = read_entries([file for *_, file in group], device)
                for (key, path, seen, _), result in zip(group, read):
                    yield key, self._settle(path, seen, result)
        finally:
            for *_, file in opened:
                os.close(file.fd)

    def recent_keys(self, max_bytes: int) -> list[bytes]:
        """Keys of this model's files, most recently used first, as many as fit in ``max_bytes`` of
        files (not checked, not touched): what a Runtime started again over the folder loads first
        (``ImageKVStore.preload``)."""
        prefix = f"{self.format.model_id[:16]}-"
        mine = [(path, size, mtime) for path, size, mtime in self._entries() if path.name.startswith(prefix)]
        keys, total = [], 0
        for path, size, _ in sorted(mine, key=lambda item: item[2], reverse=True):
            if total + size > max_bytes:
                break
            try:
                keys.append(bytes.fromhex(path.name[len(prefix):-len(SUFFIX)]))
            except ValueError:
                continue  # not a name this store writes: its load would be a miss anyway
            total += size
        return keys

    def _open(self, key: bytes, n_tokens: int | None) -> tuple[Path, os.stat_result, EntryFile] | None:
        """The file under ``key`` opened and its header checked; None (counted) when there is none
        or it is unusable (then deleted)."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # never written, or evicted (by any process)
            self._count("misses")
            return None
        seen = None
        try:
            seen = os.fstat(fd)
            return path, seen, self.format.check(fd, key, n_tokens)
        except Exception as error:  # noqa: BLE001 (whatever is wrong with the file, it is a miss)
            os.close(fd)
            self._reject(path, error, seen)
            return None

    def _settle(self, path: Path, seen: os.stat_result, read: DiskEntry | Exception) -> DiskEntry | None:
        """A read entry as a hit (the file touched as most recently used), or a failed one as a miss
        (the file deleted unless another process replaced it since ``seen``)."""
        if isinstance(read, Exception):
            self._reject(path, read, seen)
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: the entry read is whole all the same
        self._count("hits")
        return read

    def _reject(self, path: Path, error: Exception, seen: os.stat_result | None) -> None:
        """Counts an unusable file as a miss and deletes it, unless another process replaced it since
        ``seen`` (the file that was read; None when even that could not be known)."""
        logger.warning("image-KV cache file %s is unusable (%s): deleted", path, error)
        if seen is not None:
            self._delete_if_unchanged(path, seen)
        self._count("misses", "rejected")

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
            if self._pending_bytes + nbytes > pending_limit(nbytes) or self._closed:
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
        payload = self.format.encode(job.key, tensors)
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


def _groups(items: list[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """``items`` in order, cut into runs of at most ``limit`` total ``size`` (one item at least)."""
    group: list[T] = []
    total = 0
    for item in items:
        if group and total + size(item) > limit:
            yield group
            group, total = [], 0
        group.append(item)
        total += size(item)
    if group:
        yield group


def pending_limit(nbytes: int) -> int:
    """Bytes the write queue may hold when an entry of ``nbytes`` is saved."""
    return max(MAX_PENDING_BYTES, MIN_PENDING_ENTRIES * nbytes)


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
