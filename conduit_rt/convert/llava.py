"""LLaVA-1.5 in llava-hf's layout (``LlavaForConditionalGeneration``): CLIP ViT + MLP projector + Llama.

Splits the checkpoint into its three parts, builds both configs, plans every tensor (so that a
bad checkpoint fails before anything is written), then writes ``model.gguf`` (``llama_text``)
and ``mmproj.gguf`` (``clip_vision``). Tensor names of both layouts are understood: the hub's
(``language_model.model.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``) and
the one newer transformers keep in memory (``model.language_model.*``, ``model.vision_tower.*``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .. import gguf_names as names
from ..errors import UnsupportedArchitectureError
from . import clip_vision, llama_text
from . import parts
from .gguf_output import ConvertedFiles, OutputDtype
from .source import SourceCheckpoint
from .tokenizer_meta import read_model_tokenizer

logger = logging.getLogger(__name__)

HF_ARCHITECTURE = "LlavaForConditionalGeneration"
DESCRIPTION = "LLaVA-1.5 (llava-hf layout): CLIP ViT, 2-layer MLP projector, Llama decoder"

# transformers' LlavaConfig defaults (a missing vision_config means CLIP ViT-L/14 at 336 px).
LLAVA_DEFAULTS: dict[str, Any] = {
    "image_token_index": 32000, "projector_hidden_act": "gelu", "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2, "multimodal_projector_bias": True, "tie_word_embeddings": False,
}
DEFAULT_VISION_CONFIG: dict[str, Any] = {
    "model_type": "clip_vision_model", "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14,
    "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16, "projection_dim": 768,
}
_PARTS = {  # stored-name prefix -> (part, prefix of the name inside that part)
    "language_model.model.": ("text", "model."),
    "model.language_model.": ("text", "model."),
    "language_model.lm_head.": ("text", "lm_head."),
    "lm_head.": ("text", "lm_head."),
    "vision_tower.vision_model.": ("tower", ""),
    "model.vision_tower.vision_model.": ("tower", ""),
    "model.vision_tower.": ("tower", ""),
    "vision_tower.": ("tower", ""),
    "multi_modal_projector.": ("projector", ""),
    "model.multi_modal_projector.": ("projector", ""),
}


def convert(source: SourceCheckpoint, outdir: Path, dtype: OutputDtype, *, progress: bool = True) -> ConvertedFiles:
    """Write ``outdir/model.gguf`` and ``outdir/mmproj.gguf`` from a LLaVA-1.5 checkpoint."""
    hparams = LLAVA_DEFAULTS | {key: value for key, value in source.config.items() if value is not None}
    if not hparams["multimodal_projector_bias"]:
        raise UnsupportedArchitectureError(f"{source.root}: a LLaVA projector without biases is not supported")
    text_hparams = llama_text.llama_hparams(source.config.get("text_config") or {})
    tensors = split_parts(source)
    tokenizer = read_model_tokenizer(source, tensors["text"], text_hparams, "language_model.model.embed_tokens.weight")
    source_id = source.fingerprint()
    text_config = parts.build_config(source, lambda: llama_text.llama_text_config(
        text_hparams, tokenizer, image_token_id=_image_token_id(hparams), source_id=source_id, source_config=source.config,
    ))
    attention_bias = bool(text_hparams["attention_bias"])
    text_tensors = llama_text.plan_text_tensors(source, tensors["text"], text_config, dtype, attention_bias=attention_bias)
    vision_config = parts.build_config(source, lambda: clip_vision.clip_vision_config(
        clip_vision.clip_hparams(source.config.get("vision_config") or DEFAULT_VISION_CONFIG),
        projection_dim=text_config.hidden_size, feature_layer=hparams["vision_feature_layer"],
        feature_select_strategy=hparams["vision_feature_select_strategy"],
        projector_hidden_act=hparams["projector_hidden_act"], preprocessor=clip_vision.image_processor_config(source),
        processor=parts.processor_settings(source), source_id=source_id, source_config=source.config,
    ))
    vision_tensors = clip_vision.plan_vision_tensors(source, tensors["tower"], tensors["projector"], vision_config, dtype)

    outdir.mkdir(parents=True, exist_ok=True)
    common = {"dtype": dtype, "model_name": source.name, "source_config_text": source.config_text, "progress": progress}
    text_path = llama_text.write_text_model(outdir / names.TEXT_FILE_NAME, text_config, tokenizer, text_tensors, **common)
    mmproj_path = clip_vision.write_mmproj(outdir / names.MMPROJ_FILE_NAME, vision_config, vision_tensors, **common)
    return ConvertedFiles(text_model=text_path, mmproj=mmproj_path)


def split_parts(source: SourceCheckpoint) -> dict[str, dict[str, str]]:
    """{"text" | "tower" | "projector": {name inside the part: stored name}}; unknown names are refused."""
    return parts.split_parts(source, _PARTS, "LLaVA")


def _image_token_id(hparams: dict[str, Any]) -> int:
    return int(hparams.get("image_token_id", hparams["image_token_index"]))
