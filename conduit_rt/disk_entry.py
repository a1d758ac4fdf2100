"""One image entry as a file: its format, its checks, and the identity of the model it belongs to.

An entry file (safetensors) holds the entry as the in-memory stores keep it:

- ``k``, ``v``: pre-RoPE K and V of every decoder layer, model dtype [n_layers, n_tokens,
  n_kv_heads, head_dim];
- ``value_norms``: float32 [n_layers, n_tokens] (CONDUIT's scores weight attention by them);
- ``embedding`` (when the embedding cache held it): the projected image features, model dtype
  [n_tokens, hidden], where CONDUIT's recompute starts;
- metadata: the format, the 32-byte image key, the model's identity (``model_fingerprint``), the
  dtype and shapes, and a blake2b checksum over the metadata and every tensor's bytes.

``EntryFormat.decode`` gives an entry only when all of that matches what the loading model
expects; any other file raises (``UnusableEntryError``, or the safetensors library's error for a
file it cannot parse). The store that owns the files is ``disk_cache.DiskImageStore``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

FORMAT = "conduit-image-kv/1"
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


class UnusableEntryError(Exception):
    """A file that is not a valid entry for this model and key (the message says why). Never leaves
    the package: the store turns it into a miss."""


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

    def encode(self, key: bytes, tensors: dict[str, torch.Tensor]) -> bytes:
        """The file of an entry: ``tensors`` (CPU; ``k``, ``v``, ``value_norms``, maybe ``embedding``)
        with their metadata and checksum."""
        metadata = self.metadata(key, int(tensors["k"].shape[1]))
        metadata["checksum"] = checksum(tensors, metadata)
        return safetensors.torch.save(tensors, metadata)

    def decode(self, path: Path, key: bytes, n_tokens: int | None) -> DiskEntry:
        """The entry in ``path``, checked against this model, ``key`` and ``n_tokens`` (when given);
        UnusableEntryError (or the library's error) otherwise."""
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            expected = self.metadata(key, int(metadata.get("n_tokens", "0")))
            for field, value in expected.items():
                if metadata.get(field) != value:
                    raise UnusableEntryError(f"{field} is {metadata.get(field)!r}, expected {value!r}")
            n = int(expected["n_tokens"])
            if n <= 0 or (n_tokens is not None and n != n_tokens):
                raise UnusableEntryError(f"{n} tokens, expected {n_tokens}")
            shapes = self.shapes(n)
            names = set(f.keys())
            if not set(shapes) - {"embedding"} <= names <= set(shapes):
                raise UnusableEntryError(f"tensors {sorted(names)}, expected {sorted(shapes)}")
            for name in names:
                if list(f.get_slice(name).get_shape()) != shapes[name]:
                    raise UnusableEntryError(f"{name} has shape {f.get_slice(name).get_shape()}, "
                                             f"expected {shapes[name]}")
            tensors = {name: f.get_tensor(name) for name in names}
        for name, tensor in tensors.items():
            want = torch.float32 if name == "value_norms" else self.layout.dtype
            if tensor.dtype != want:
                raise UnusableEntryError(f"{name} has dtype {tensor.dtype}, expected {want}")
        if metadata.get("checksum") != checksum(tensors, metadata):
            raise UnusableEntryError("checksum mismatch")
        return DiskEntry(tensors["k"], tensors["v"], tensors["value_norms"], tensors.get("embedding"))


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
