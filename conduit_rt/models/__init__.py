"""Model code and the architecture registry.

An architecture is one module with a ``load(text_path, mmproj_path, device, dtype)`` function that
returns a ``base.VisionLanguageModel``, plus one entry in ``ARCHITECTURES`` keyed by the text file's
``general.architecture`` (LLaVA-1.5's decoder is a plain "llama"; Qwen2-VL's would be "qwen2vl").
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.gguf_keys import KeyReader
from conduit_rt.gguf_names import TYPE_MMPROJ, Keys
from conduit_rt.model_file import open_gguf

from .base import ForwardBatch, LayerCapture, ModelAssets, ModelConfig, VisionLanguageModel

# text model general.architecture -> module implementing it
ARCHITECTURES: dict[str, str] = {
    "llama": "conduit_rt.models.llava",
}


def text_architecture(text_path: str | Path) -> str:
    """The ``general.architecture`` key of a text model file (an mmproj file is refused)."""
    path = Path(text_path)
    keys = KeyReader(open_gguf(path), path)
    if keys.str(Keys.General.TYPE, default="") == TYPE_MMPROJ:
        raise ModelFormatError(
            f"{path} is a vision (mmproj) file: pass the text model.gguf first and this file as mmproj"
        )
    return keys.str(Keys.General.ARCHITECTURE)


def load_model(
    text_path: str | Path,
    mmproj_path: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> VisionLanguageModel:
    """Load a converted model (``model.gguf``, and ``mmproj.gguf`` for images) onto ``device``.

    dtype: default float32 on CPU, bfloat16 on CUDA. Raises ``ModelFormatError`` (naming the file
    and the key or tensor at fault) or ``UnsupportedArchitectureError``.
    """
    arch = text_architecture(text_path)
    module_name = ARCHITECTURES.get(arch)
    if module_name is None:
        raise UnsupportedArchitectureError(
            f"{text_path}: architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return importlib.import_module(module_name).load(text_path, mmproj_path, device, dtype)


__all__ = [
    "ARCHITECTURES",
    "ForwardBatch",
    "LayerCapture",
    "ModelAssets",
    "ModelConfig",
    "VisionLanguageModel",
    "load_model",
    "text_architecture",
]
