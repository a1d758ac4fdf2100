"""Top-k selection through the native library (``conduit_topk`` in conduit.h).

``top_k_indices(scores, k)`` returns the indices of the k largest scores in ascending order, which is
what selection wants (token order), without a sort: on CUDA a radix select in five kernel launches
on torch's current stream, with no allocation and no host synchronisation after the first call; on
the CPU nth_element. The order is deterministic and the same on both backends: NaN ranks above
+inf, -0.0 equals +0.0, and among equal scores the lower index wins.

The native call needs a workspace; one is cached per (device, stream), zero-filled when made (the
CUDA kernels leave it zero-filled after each call), and grown when a larger ``n`` needs more. Calls
on one stream are ordered, so they share it safely.
"""
from __future__ import annotations

import functools

import torch

from . import native
from .errors import InvalidArgumentError

_workspaces: dict[tuple[str, int | None, int], torch.Tensor] = {}


@functools.lru_cache(maxsize=None)
def native_backend_ready(device_type: str) -> bool:
    """Whether the loaded library can run top-k on ``device_type`` ("cpu" or "cuda")."""
    return native.backends().get(device_type, {}).get("available", False)


def _stream_of(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _workspace(device: torch.device, stream: int, nbytes: int) -> torch.Tensor:
    key = (device.type, device.index, stream)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < nbytes:
        ws = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)
        _workspaces[key] = ws
    return ws


def _check(scores: torch.Tensor, k: int) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise InvalidArgumentError(f"scores must be a 1-D tensor, got {getattr(scores, 'shape', type(scores))}")
    n = scores.numel()
    if not 0 <= k <= n:
        raise InvalidArgumentError(f"top-k needs 0 <= k <= n, got k = {k} for n = {n} scores")
    if n >= 2**31:
        raise InvalidArgumentError(f"top-k takes fewer than 2^31 scores, got {n}")


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ascending.

    scores: [n], any floating dtype (read as float32), CPU or CUDA. Returns int64 [k] on
    ``scores.device``. Raises InvalidArgumentError for a non-1-D input or k outside [0, n]. Where
    the library lacks the device's backend, falls back to torch.topk + sort (whose order among
    ties and NaNs is torch's, not the one above).
    """
    _check(scores, k)
    device = scores.device
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    if device.type not in ("cpu", "cuda") or not native_backend_ready(device.type):
        return torch.sort(torch.topk(scores, k).indices).values
    scores = scores.detach().to(torch.float32).contiguous()
    ffi, lib = native.load()
    backend = lib.CONDUIT_BACKEND_CUDA if device.type == "cuda" else lib.CONDUIT_BACKEND_CPU
    n = scores.numel()
    nbytes = lib.conduit_topk_workspace_bytes(backend, n)
    stream = _stream_of(device)
    ws = _workspace(device, stream, nbytes)
    out = torch.empty(k, dtype=torch.long, device=device)
    status = lib.conduit_topk(backend, device.index or 0, ffi.cast("const float *", scores.data_ptr()), n, k,
                              lib.CONDUIT_INDEX_I64, ffi.cast("void *", out.data_ptr()),
                              ffi.cast("void *", ws.data_ptr()), ws.numel(), ffi.cast("void *", stream))
    native.check(status, "top-k")
    return out
