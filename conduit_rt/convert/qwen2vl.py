"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``).

Splits the checkpoint into its text decoder and its ``visual`` module, builds both configs, plans
every tensor (a bad checkpoint fails before anything is written), then writes ``model.gguf``
(``qwen2vl_text``) and ``mmproj.gguf`` (``qwen2vl_vision``). Both stored layouts are understood: the
hub's (``model.layers.*``, ``visual.*``, ``lm_head.*``, which transformers 5 also saves) and the one
transformers 4.5x saved (``model.language_model.*``, ``model.visual.*``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .. import gguf_names as names
from ..errors import UnsupportedArchitectureError
from . import qwen2vl_text, qwen2vl_vision
from .clip_vision import image_processor_config
from . import parts
from .gguf_output import ConvertedFiles, OutputDtype
from .source import SourceCheckpoint
from .tokenizer_meta import read_model_tokenizer

logger = logging.getLogger(__name__)

QWEN2VL = "Qwen2VLForConditionalGeneration"
QWEN25VL = "Qwen2_5_VLForConditionalGeneration"
HF_ARCHITECTURES = (QWEN2VL, QWEN25VL)
HF_ARCHITECTURE = QWEN2VL  # the registry lists every name of HF_ARCHITECTURES
DESCRIPTION = "Qwen2-VL / Qwen2.5-VL: dynamic-resolution ViT with 2-D RoPE (+ window attention), 2x2 merger, Qwen2 decoder with M-RoPE"
DEFAULT_IMAGE_TOKEN_ID = 151655  # <|image_pad|> in Qwen's vocabulary
MODEL_TYPES = {"qwen2_vl": False, "qwen2_5_vl": True}  # config.json model_type -> is Qwen2.5-VL
_PARTS = {  # stored-name prefix -> (part, prefix of the name inside that part)
    "model.language_model.": ("text", "model."),
    "model.visual.": ("vision", ""),
    "visual.": ("vision", ""),
    "lm_head.": ("text", "lm_head."),
    "model.": ("text", "model."),
}


def convert(source: SourceCheckpoint, outdir: Path, dtype: OutputDtype, *, progress: bool = True) -> ConvertedFiles:
    """Write ``outdir/model.gguf`` and ``outdir/mmproj.gguf`` from a Qwen2-VL or Qwen2.5-VL checkpoint."""
    is_qwen25 = _is_qwen25(source)
    tensors = split_parts(source)
    text_hparams = parts.build_config(source, lambda: qwen2vl_text.qwen2vl_text_hparams(source.config))
    tokenizer = read_model_tokenizer(source, tensors["text"], text_hparams, "model.embed_tokens.weight")
    source_id = source.fingerprint()
    image_token_id = int(source.config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    text_config = parts.build_config(source, lambda: qwen2vl_text.qwen2vl_text_config(
        text_hparams, tokenizer, image_token_id=image_token_id, source_id=source_id, source_config=source.config,
    ))
    text_tensors = qwen2vl_text.plan_text_tensors(source, tensors["text"], text_config, dtype)
    vision_config = parts.build_config(source, lambda: qwen2vl_vision.qwen_vision_config(
        source.config.get("vision_config") or {}, is_qwen25=is_qwen25, text_hidden=text_config.hidden_size,
        preprocessor=image_processor_config(source), processor=parts.processor_settings(source), source_id=source_id,
        source_config=source.config,
    ))
    vision_tensors = qwen2vl_vision.plan_vision_tensors(source, tensors["vision"], vision_config, dtype)

    outdir.mkdir(parents=True, exist_ok=True)
    common = {"dtype": dtype, "model_name": source.name, "source_config_text": source.config_text, "progress": progress}
    text_path = qwen2vl_text.write_text_model(outdir / names.TEXT_FILE_NAME, text_config, tokenizer, text_tensors, **common)
    mmproj_path = qwen2vl_vision.write_mmproj(outdir / names.MMPROJ_FILE_NAME, vision_config, vision_tensors, **common)
    return ConvertedFiles(text_model=text_path, mmproj=mmproj_path)


def _is_qwen25(source: SourceCheckpoint) -> bool:
    """From config.json's model_type, which must agree with the declared architecture."""
    model_type = source.config.get("model_type")
    if model_type not in MODEL_TYPES:
        from .registry import supported_architectures  # the registry imports this module

        declared = ", ".join(source.config.get("architectures") or [])
        raise UnsupportedArchitectureError(
            f"{source.name}: config.json declares {declared} but its model_type is {model_type!r}, not one of "
            f"{', '.join(MODEL_TYPES)}; it cannot be converted as Qwen2-VL. Supported architectures:\n{supported_architectures()}"
        )
    return MODEL_TYPES[model_type]


def split_parts(source: SourceCheckpoint) -> dict[str, dict[str, str]]:
    """{"text" | "vision": {name inside the part: stored name}}; unknown names are refused."""
    return parts.split_parts(source, _PARTS, "Qwen2-VL")
