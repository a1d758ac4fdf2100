"""conduit-rt: a compact runtime for vision-language models that see the same images again and again.

``Runtime`` loads a model and answers chat requests (``GenerationOptions``: sampling, refresh and
compression settings); ``KVArena`` is the native KV cache.
"""
from __future__ import annotations

from pathlib import Path

from .errors import (  # noqa: F401
    ArenaFullError,
    ConduitError,
    InvalidArgumentError,
    ModelFormatError,
    NativeError,
    RequestError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"

# The small LLaVA trained on the quality task (evaluation/task/), shipped as a Hugging Face folder:
# ``Runtime(BUNDLED_MODEL)`` converts it to GGUF once and caches it.
BUNDLED_MODEL = Path(__file__).resolve().parent / "data" / "quality_model"


def __getattr__(name: str):
    # Heavy pieces load on first use, so that `import conduit_rt` stays cheap.
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    if name == "GenerationOptions":
        from .options import GenerationOptions

        return GenerationOptions
    if name in ("KVArena", "KernelTuning", "Sequence", "ImageEntry", "ArenaStats", "DecodeStep"):
        from . import arena

        return getattr(arena, name)
    raise AttributeError(f"module 'conduit_rt' has no attribute {name!r}")
