"""Typed errors of conduit-rt. Each says what went wrong and, where it can, what to do next.

Native statuses map one to one onto the ``NativeError`` subclasses (see ``native.py``); the
others are raised by the Python side (model files, requests).
"""
from __future__ import annotations


class ConduitError(Exception):
    """Base class of every error conduit-rt raises on purpose."""


class NativeError(ConduitError):
    """A call into the native library failed. ``status`` is the native status code."""

    status: int = 0
    fatal: bool = False

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(NativeError, ValueError):
    """An argument was out of range: a bad shape, slot, layer, dtype or a null handle."""

    status = 1


class ArenaFullError(NativeError, MemoryError):
    """The KV arena has no free block left, even after evicting unused image entries.

    Recoverable: free sequences, compress, or create the runtime with a larger ``kv_cache_bytes``.
    """

    status = 2


class NotFoundError(NativeError, KeyError):
    """No cached image entry under that key."""

    status = 3

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AlreadyExistsError(NativeError):
    """An image entry under that key already exists."""

    status = 4


class UnsupportedError(NativeError):
    """The backend was not compiled into the library, or no device is present."""

    status = 5


class DeviceOutOfMemoryError(NativeError, MemoryError):
    """A host or device allocation failed."""

    status = 6


class InUseError(NativeError):
    """The object is still referenced and cannot be removed."""

    status = 7


class DeviceError(NativeError):
    """A CUDA call failed. Fatal: the arena's state is unknown; free it and start again."""

    status = -1
    fatal = True


class InternalError(NativeError):
    """A broken invariant inside the native library (a bug). Fatal."""

    status = -2
    fatal = True


class LibraryNotFoundError(ConduitError, OSError):
    """The native library could not be found or loaded (set CONDUIT_LIB to its path)."""


class ModelFormatError(ConduitError, ValueError):
    """A model file is malformed, truncated, or does not match what was expected.

    The message names the file and the key or tensor at fault.
    """


class UnsupportedArchitectureError(ConduitError, ValueError):
    """The checkpoint's architecture is not one conduit-rt can convert or run."""


class RequestError(ConduitError, ValueError):
    """A request (messages, images, sampling parameters) is malformed."""


class ContextOverflowError(RequestError):
    """A request needs more tokens than the runtime can hold: its prompt (text and image tokens), or
    the prompt plus ``max_tokens``, exceeds the model's context length (the GGUF's
    ``context_length``) or the tokens of KV one sequence can ever have in the arena
    (``kv_cache_bytes``). Refused before any KV is allocated; send fewer images or less text, lower
    ``max_tokens``, or give the Runtime a larger ``kv_cache_bytes``. ``needed`` and ``limit`` are
    the token counts compared."""

    def __init__(self, message: str, needed: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.needed, self.limit = needed, limit


class InvalidImageError(RequestError):
    """An image cannot be used: unreadable, not a format PIL decodes, truncated, without pixels, or
    animated (more than one frame). The message names the image and what to send instead."""


class ImageTooLargeError(InvalidImageError):
    """An image has more pixels than conduit-rt decodes (``preprocess.MAX_IMAGE_PIXELS``, its guard
    against decompression bombs), or preprocessing would make one that large (a very long, thin
    image): downscale or crop it before sending it."""


class NonFiniteLogitsError(ConduitError, ArithmeticError):
    """The model produced NaN or infinite logits: its weights are corrupted (or overflow in this
    dtype). The message names the model file; convert the checkpoint again, or load it in float32.
    The request's KV is freed; the Runtime stays usable."""


class DeviceUnavailableError(ConduitError, ValueError):
    """The requested device is not one this process can run on (no such device, no CUDA, or not a
    device conduit-rt supports); the message lists the devices that are available."""


class RuntimeClosedError(ConduitError, RuntimeError):
    """The Runtime was closed (``Runtime.close``, or the end of its ``with`` block): its KV arena and
    caches are freed. Create a new Runtime to answer more requests."""


class MissingExtraError(ConduitError, ImportError):
    """An optional package a command needs is not installed; the message names the pip extra that
    installs it (``pip install 'conduit-rt[eval]'``)."""


NATIVE_ERRORS: dict[int, type[NativeError]] = {
    cls.status: cls
    for cls in (
        InvalidArgumentError,
        ArenaFullError,
        NotFoundError,
        AlreadyExistsError,
        UnsupportedError,
        DeviceOutOfMemoryError,
        InUseError,
        DeviceError,
        InternalError,
    )
}


class TensorParallelError(ConduitError, ValueError):
    """A tensor-parallel Runtime cannot be made or asked as it was: the model's attention heads, KV
    heads or MLP width are not divisible by ``tensor_parallel``, there are fewer GPUs than ranks, a
    ``torchrun`` world of another size, or an option whose work is not split across ranks (a cache
    folder, a refresh policy that ranks tokens by the norms of their K and V changes). The message
    says which and what to use instead."""


class WorkerFailedError(ConduitError, RuntimeError):
    """A worker process of a tensor-parallel Runtime crashed, was killed or raised an error that the
    other ranks did not share. The message names the rank, its exit code and its error when it sent
    one. The other workers are stopped and the Runtime is closed: create a new one."""
