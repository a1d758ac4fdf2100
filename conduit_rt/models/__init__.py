"""Model code and the architecture registry.

An architecture is one module with a ``load(text_path, mmproj_path, device, dtype, shard=None)``
function that returns a ``base.VisionLanguageModel``, plus one entry in ``ARCHITECTURES`` keyed by
the text file's ``general.architecture`` (LLaVA-1.5's decoder is a plain "llama"; Qwen2-VL's is
"qwen2vl").
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.gguf_names import TYPE_MMPROJ, Keys
from conduit_rt.gguf_parser import read_string_keys

from .base import ForwardBatch, LayerCapture, ModelAssets, ModelConfig, PreparedImage, VisionLanguageModel

if TYPE_CHECKING:
    from conduit_rt.parallel.sharding import DecoderShard

# text model general.architecture -> module implementing it
ARCHITECTURES: dict[str, str] = {
    "llama": "conduit_rt.models.llava",
    "qwen2vl": "conduit_rt.models.qwen2vl",  # Qwen2-VL and Qwen2.5-VL (the mmproj's projector tells them apart)
    "qwen2": "conduit_rt.models.internvl",  # InternVL3's Qwen2 decoder (a text-only Qwen2 without an mmproj)
    "qwen3vl": "conduit_rt.models.qwen3vl",
}


def text_architecture(text_path: str | Path) -> str:
    """The ``general.architecture`` key of a text model file (an mmproj file is refused).

    Reads the keys only until both are found (the architecture module parses the whole file once,
    after this dispatch); every length read on the way is checked against the file's size.
    """
    path = Path(text_path)
    found = read_string_keys(path, (Keys.General.ARCHITECTURE, Keys.General.TYPE))
    if found.get(Keys.General.TYPE) == TYPE_MMPROJ:
        raise ModelFormatError(
            f"{path} is a vision (mmproj) file: pass the text model.gguf first and this file as mmproj"
        )
    if Keys.General.ARCHITECTURE not in found:
        raise ModelFormatError(f"{path}: missing key {Keys.General.ARCHITECTURE} (a string)")
    return found[Keys.General.ARCHITECTURE]


def load_model(
    text_path: str | Path,
    mmproj_path: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    shard: DecoderShard | None = None,
) -> VisionLanguageModel:
    """Load a converted model (``model.gguf``, and ``mmproj.gguf`` for images) onto ``device``.

    dtype: default float32 on CPU, bfloat16 on CUDA. shard: a tensor-parallel rank's
    ``parallel.sharding.DecoderShard``: only the rank's share of the decoder is built and read
    from the file, and the vision weights only on rank 0 (``model.config`` is the share). Raises
    ``ModelFormatError`` (naming the file and the key or tensor at fault),
    ``UnsupportedArchitectureError``, or ``TensorParallelError`` for a decoder the shard cannot split.
    """
    arch = text_architecture(text_path)
    module_name = ARCHITECTURES.get(arch)
    if module_name is None:
        raise UnsupportedArchitectureError(
            f"{text_path}: architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return importlib.import_module(module_name).load(text_path, mmproj_path, device, dtype, shard=shard)


__all__ = [
    "ARCHITECTURES",
    "ForwardBatch",
    "LayerCapture",
    "ModelAssets",
    "ModelConfig",
    "PreparedImage",
    "VisionLanguageModel",
    "load_model",
    "text_architecture",
]
