"""Model code and the architecture registry.

An architecture is one module with a ``load(text_path, mmproj_path, device, dtype)`` function that
returns a ``base.VisionLanguageModel``, plus one entry in ``ARCHITECTURES`` keyed by the text file's
``general.architecture`` (LLaVA-1.5's decoder is a plain "llama"; Qwen2-VL's is "qwen2vl").
"""

from __future__ import annotations

import importlib
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.gguf_names import TYPE_MMPROJ, Keys

from .base import ForwardBatch, LayerCapture, ModelAssets, ModelConfig, PreparedImage, VisionLanguageModel

# text model general.architecture -> module implementing it
ARCHITECTURES: dict[str, str] = {
    "llama": "conduit_rt.models.llava",
    "qwen2vl": "conduit_rt.models.qwen2vl",  # Qwen2-VL and Qwen2.5-VL (the mmproj's projector tells them apart)
}


def text_architecture(text_path: str | Path) -> str:
    """The ``general.architecture`` key of a text model file (an mmproj file is refused)."""
    path = Path(text_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file (convert a checkpoint with `conduit convert`)")
    found = _header_strings(path, (Keys.General.ARCHITECTURE, Keys.General.TYPE))
    if found.get(Keys.General.TYPE) == TYPE_MMPROJ:
        raise ModelFormatError(
            f"{path} is a vision (mmproj) file: pass the text model.gguf first and this file as mmproj"
        )
    if Keys.General.ARCHITECTURE not in found:
        raise ModelFormatError(f"{path}: missing key {Keys.General.ARCHITECTURE}")
    return found[Keys.General.ARCHITECTURE]


# GGUF value type -> byte size of a scalar (8 = string, 9 = array are variable)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _header_strings(path: Path, wanted: tuple[str, ...]) -> dict[str, str]:
    """The string values of ``wanted`` keys, scanning the key/value section only until all are found.

    A full ``GGUFReader`` parse costs seconds on a 32K-token vocabulary; the architecture module
    parses the file once, properly, after this dispatch.
    """
    found: dict[str, str] = {}
    try:
        with path.open("rb") as handle:
            magic, _version, _n_tensors, n_kv = struct.unpack("<4sIQQ", handle.read(24))
            if magic != b"GGUF":
                raise ModelFormatError(f"{path}: not a GGUF file (magic {magic!r})")
            for _ in range(n_kv):
                key = _read_string(handle)
                (kind,) = struct.unpack("<I", handle.read(4))
                if kind == _STRING and key in wanted:
                    found[key] = _read_string(handle)
                    if len(found) == len(wanted):
                        break
                else:
                    _skip_value(handle, kind)
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ModelFormatError(f"{path}: truncated or corrupt GGUF header ({exc})") from exc
    return found


def _read_string(handle: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", handle.read(8))
    return handle.read(length).decode("utf-8")


def _skip_value(handle: BinaryIO, kind: int) -> None:
    if kind == _STRING:
        (length,) = struct.unpack("<Q", handle.read(8))
        handle.seek(length, 1)
    elif kind == _ARRAY:
        item_kind, count = struct.unpack("<IQ", handle.read(12))
        if item_kind in _SCALAR_BYTES:
            handle.seek(count * _SCALAR_BYTES[item_kind], 1)
        else:
            for _ in range(count):
                _skip_value(handle, item_kind)
    else:
        handle.seek(_SCALAR_BYTES[kind], 1)


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
    "PreparedImage",
    "VisionLanguageModel",
    "load_model",
    "text_architecture",
]
