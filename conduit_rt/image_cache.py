"""The image caches of a Runtime. Two are keyed by the image's 32-byte identity (preprocess.image_key),
one by the encoded file an image came in:

- ``DecodedImages``: sha256 of an encoded file (a path's content or bytes) -> its RGB pixels and
  identity, LRU under a byte budget. A recurring image sent as a file skips decoding and hashing
  its pixels, the host work every request does before its first kernel (CONDUIT restores nothing
  before it knows which images it holds).
- ``EmbeddingCache``: projected vision features of an image, [n_tokens, hidden] on the model's
  device, LRU under a byte budget (the recompute pass of CONDUIT starts from them).
- ``ImageKVStore``: pre-RoPE K and V of an image's tokens for every decoder layer, in the native
  arena's image store (LRU under ``image_cache_bytes``, entries in use never evicted), plus the
  per-layer value norms of each entry, computed once when the entry is stored (CONDUIT's scores
  weight attention by them). With a ``disk_cache.DiskImageStore`` (``Runtime(cache_dir=...)``),
  every entry stored is also written to disk with its norms and embedding, and an entry missing
  from the arena is looked for there: a valid file is loaded into the arena (its embedding into
  the ``EmbeddingCache``) and used as an entry stored in this process would be. The images of one
  request that are on disk only are read together (``ImageKVStore.preloaded``), and a Runtime
  started again over its folder can load the most recent entries before its first request
  (``ImageKVStore.preload``).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .arena import ImageEntry, KVArena
from .disk_cache import DiskImageStore
from .disk_entry import DiskEntry
from .errors import AlreadyExistsError, ArenaFullError

logger = logging.getLogger(__name__)


class DecodedImages:
    """sha256 of an encoded image file -> (RGB pixels [H, W, 3] uint8, read-only; image key), least
    recently used evicted past ``max_bytes`` of pixels. Thread-safe: a request's images are decoded
    by a thread pool."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, tuple[np.ndarray, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def digest(encoded: bytes) -> bytes:
        return hashlib.sha256(encoded).digest()

    def get(self, digest: bytes) -> tuple[np.ndarray, bytes] | None:
        with self._lock:
            found = self._items.get(digest)
            if found is not None:
                self._items.move_to_end(digest)
            return found

    def put(self, digest: bytes, rgb: np.ndarray, key: bytes) -> None:
        """Keeps a read-only view of ``rgb`` (the caller's array stays writable if it was)."""
        size = rgb.nbytes
        if size > self.max_bytes:
            return
        frozen = rgb.view()
        frozen.flags.writeable = False
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self.bytes -= old[0].nbytes
            while self._items and self.bytes + size > self.max_bytes:
                _, (evicted, _) = self._items.popitem(last=False)
                self.bytes -= evicted.nbytes
            self._items[digest] = (frozen, key)
            self.bytes += size

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)


class EmbeddingCache:
    """image key -> features [n_tokens, hidden]; least recently used evicted past ``max_bytes``. Not
    thread-safe: a Runtime touches it only holding its lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes) -> torch.Tensor | None:
        features = self._items.get(key)
        if features is not None:
            self._items.move_to_end(key)
        return features

    def put(self, key: bytes, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes:
            return
        if key in self._items:
            self.bytes -= self._nbytes(self._items.pop(key))
        while self._items and self.bytes + size > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.bytes -= self._nbytes(evicted)
        self._items[key] = features
        self.bytes += size

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()


@dataclass(slots=True)
class CachedImage:
    """A held reference to a stored image: the native entry and its value norms float32 [L, n_tokens];
    ``from_disk`` when this lookup loaded it from the disk store."""

    key: bytes
    entry: ImageEntry
    value_norms: torch.Tensor
    from_disk: bool = False

    @property
    def n_tokens(self) -> int:
        return self.entry.n_tokens

    def release(self) -> None:
        self.entry.release()


class ImageKVStore:
    """Pre-RoPE image KV of every layer in the arena's image store, with value norms beside it; with
    ``disk``, also on disk (entries with their embedding from ``embeddings``). Not thread-safe (nor
    is the arena): a Runtime touches it only holding its lock."""

    def __init__(self, arena: KVArena, disk: DiskImageStore | None = None,
                 embeddings: EmbeddingCache | None = None) -> None:
        self.arena, self.disk, self.embeddings = arena, disk, embeddings
        self._norms: dict[bytes, torch.Tensor] = {}
        # key -> what ``preloaded`` found on disk (None: the file was unusable) for ``acquire`` to take
        self._preloaded: dict[bytes, CachedImage | None] = {}

    @property
    def enabled(self) -> bool:
        return self.arena.image_cache_bytes > 0

    def acquire(self, key: bytes, n_tokens: int | None = None) -> CachedImage | None:
        """A reference to the stored image (release it when the request ends), or None. An image not
        in the arena is loaded from the disk store, if there (of ``n_tokens`` tokens, when given),
        unless ``preloaded`` already looked for it."""
        if not self.enabled:
            return None
        if key in self._preloaded:
            return self._preloaded.pop(key)
        entry = self.arena.acquire_image(key)
        if entry is None:
            self._norms.pop(key, None)  # evicted natively since we last saw it
            return self._load(key, n_tokens)
        return CachedImage(key, entry, self._norms[key])

    @contextlib.contextmanager
    def preloaded(self, wanted: dict[bytes, int | None]) -> Iterator[None]:
        """Within: the images of ``wanted`` (key -> n_tokens, or None for any) that the arena lacks
        and the disk store holds are loaded from disk together, as ``acquire`` would load them one
        by one (the files read at once, ``DiskImageStore.load_many``), and held for the first
        ``acquire`` of each key. Leaving releases those no ``acquire`` took."""
        try:
            if self.enabled and self.disk is not None:
                on_disk = {key: n for key, n in wanted.items()
                           if not self.arena.has_image(key) and self.disk.contains(key)}
                for key, cached in self._load_many(on_disk):
                    self._preloaded[key] = cached  # held here at once: released below whatever happens
            yield
        finally:
            for cached in self._preloaded.values():
                if cached is not None:
                    cached.release()
            self._preloaded.clear()

    def preload(self) -> int:
        """Loads the disk store's most recently used entries into the arena, as many as the image
        store's free budget holds, and returns how many it loaded. A Runtime started again over its
        cache folder calls it before its first request (``Runtime.preload_images``), so that
        request's images are hits in memory rather than loads from disk on its path. The files are
        loaded oldest first, so the arena's LRU order is the folder's; unusable files are misses
        (deleted), as in ``acquire``."""
        if not self.enabled or self.disk is None:
            return 0
        free = self.arena.image_cache_bytes - self.arena.stats().image_bytes
        keys = [key for key in self.disk.recent_keys(free) if not self.arena.has_image(key)]
        loaded = 0
        for _, cached in self._load_many(dict.fromkeys(reversed(keys))):
            if cached is not None:
                cached.release()  # the entry stays in the arena, unreferenced, like any stored one
                loaded += 1
        return loaded

    def store(self, key: bytes, k_pre_rope: list[torch.Tensor], v: list[torch.Tensor]) -> bool:
        """Stores one image: per layer K (before RoPE) and V [n_tokens, n_kv_heads, head_dim]; and
        queues it for the disk store, with its embedding when the embedding cache holds it.

        Returns False (and stores nothing in the arena) when the store is disabled or cannot make
        room; caching is an optimisation, never a reason for a request to fail.
        """
        if not self.enabled:
            return False
        # norm over all KV heads of each token's V, per layer: [L, n_tokens]
        norms = torch.stack([vv.float().flatten(1).norm(dim=1) for vv in v])
        stored = self._put(key, k_pre_rope, v, norms)
        if self.disk is not None:
            embedding = self.embeddings.get(key) if self.embeddings is not None else None
            self.disk.save(key, k_pre_rope, v, norms, embedding)
        return stored

    def _put(self, key: bytes, k_pre_rope: list[torch.Tensor], v: list[torch.Tensor], norms: torch.Tensor) -> bool:
        """Writes an entry into the arena's image store, with its value norms float32 [L, n_tokens]."""
        try:
            entry = self.arena.create_image(key, int(k_pre_rope[0].shape[0]))
        except (AlreadyExistsError, ArenaFullError) as error:
            logger.debug("image KV not stored: %s", error)
            return False
        try:
            for layer, (k, vv) in enumerate(zip(k_pre_rope, v)):
                entry.write(layer, k.contiguous(), vv.contiguous())
            entry.commit()
            self._norms[key] = norms
        finally:
            entry.release()
        self._forget_evicted()
        return True

    def _load(self, key: bytes, n_tokens: int | None) -> CachedImage | None:
        """The entry under ``key`` loaded from the disk store into the arena (and its embedding into
        the embedding cache), or None: no disk store, no valid file, or no room in the arena."""
        if self.disk is None:
            return None
        return dict(self._load_many({key: n_tokens}))[key]

    def _load_many(self, wanted: dict[bytes, int | None]) -> Iterator[tuple[bytes, CachedImage | None]]:
        """(key, ``_load`` of it) for each key of ``wanted`` (key -> n_tokens), the files read
        together. Each entry goes into the arena (the disk store checked it whole: its checksum
        matched) as its group of files is read, so no more than a group is on the device beside the
        arena."""
        for key, found in self.disk.load_many(wanted, self.arena.device):
            yield key, self._adopt(key, found) if found is not None else None

    def _adopt(self, key: bytes, found: DiskEntry) -> CachedImage | None:
        """A checked entry from disk (its tensors on the arena's device) put into the arena, its
        embedding into the embedding cache; None when the arena has no room."""
        if not self._put(key, list(found.k), list(found.v), found.value_norms):
            return None
        if found.embedding is not None and self.embeddings is not None:
            self.embeddings.put(key, found.embedding)
        entry = self.arena.acquire_image(key)
        return CachedImage(key, entry, self._norms[key], from_disk=True) if entry is not None else None

    def _forget_evicted(self) -> None:
        """Drops the norms of entries the native store evicted (it evicts on its own, LRU)."""
        if len(self._norms) > 2 * self.arena.stats().n_image_entries + 8:
            for key in [k for k in self._norms if not self.arena.has_image(k)]:
                del self._norms[key]
