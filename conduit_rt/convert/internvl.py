"""InternVL3 in the hub's ``-hf`` layout (``InternVLForConditionalGeneration``): InternViT + MLP projector + Qwen2.

Splits the checkpoint into its text decoder, vision tower and projector, builds both configs, plans
every tensor (a bad checkpoint fails before anything is written), then writes ``model.gguf`` and
``mmproj.gguf`` (``internvl_vision``). The decoder is written as llama.cpp writes InternVL3's: a plain
"qwen2" model (q/k/v biases, rows as stored: llama.cpp permutes only Llama's), keys ``qwen2.*``.
Both stored layouts are understood: the hub's (``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``) and the one transformers keeps in memory (``model.language_model.*``, ...).

RoPE: a "dynamic" (NTK) scaling in the text config is written as plain RoPE. transformers' dynamic
RoPE changes the frequencies only for sequences longer than ``max_position_embeddings``, and no
request is ever longer than that (it is the file's context length).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from gguf import GGUFWriter

from .. import gguf_names as names
from ..errors import UnsupportedArchitectureError
from ..model_config import TextModelConfig
from . import internvl_vision, llama_text, parts, qwen2vl_text
from .clip_vision import image_processor_config
from .llava import _PARTS as LLAVA_PARTS
from .gguf_output import ConvertedFiles, OutputDtype, PlannedTensor, write_gguf
from .source import SourceCheckpoint
from .tokenizer_meta import TokenizerMeta, read_model_tokenizer

logger = logging.getLogger(__name__)

HF_ARCHITECTURE = "InternVLForConditionalGeneration"
DESCRIPTION = "InternVL3 (-hf layout): InternViT over 448-px tiles + thumbnail, pixel shuffle 0.5, MLP projector, Qwen2 decoder"
DEFAULT_IMAGE_TOKEN_ID = 151667  # <IMG_CONTEXT> in InternVL3's vocabulary
# stored-name prefix -> (part, prefix of the name inside that part): LLaVA's layouts, whose towers
# InternVL stores without CLIP's inner "vision_model."
_PARTS = {prefix: part for prefix, part in LLAVA_PARTS.items() if "vision_model." not in prefix}


def convert(source: SourceCheckpoint, outdir: Path, dtype: OutputDtype, *, progress: bool = True) -> ConvertedFiles:
    """Write ``outdir/model.gguf`` and ``outdir/mmproj.gguf`` from an InternVL3 ``-hf`` checkpoint."""
    tensors = parts.split_parts(source, _PARTS, "InternVL")
    text_hparams = parts.build_config(source, lambda: internvl_text_hparams(source.config))
    tokenizer = read_model_tokenizer(source, tensors["text"], text_hparams, "language_model.model.embed_tokens.weight")
    source_id = source.fingerprint()
    image_token_id = int(source.config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    text_config = parts.build_config(source, lambda: qwen2_text_config(
        text_hparams, tokenizer, image_token_id=image_token_id, source_id=source_id, source_config=source.config,
    ))
    text_tensors = qwen2vl_text.plan_text_tensors(source, tensors["text"], text_config, dtype)
    vision_config = parts.build_config(source, lambda: internvl_vision.internvl_vision_config(
        source, text_hidden=text_config.hidden_size, preprocessor=image_processor_config(source),
        processor=parts.processor_settings(source), source_id=source_id,
    ))
    vision_tensors = internvl_vision.plan_vision_tensors(source, tensors["tower"], tensors["projector"], vision_config, dtype)

    outdir.mkdir(parents=True, exist_ok=True)
    common = {"dtype": dtype, "model_name": source.name, "source_config_text": source.config_text, "progress": progress}
    text_path = write_text_model(outdir / names.TEXT_FILE_NAME, text_config, tokenizer, text_tensors, **common)
    mmproj_path = internvl_vision.write_mmproj(outdir / names.MMPROJ_FILE_NAME, vision_config, vision_tensors, **common)
    return ConvertedFiles(text_model=text_path, mmproj=mmproj_path)


def internvl_text_hparams(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The Qwen2 text hyperparameters (``qwen2vl_text.qwen2vl_text_hparams``, which reads the same
    Qwen2 config), with the RoPE reduced to its base; refuses a decoder other than Qwen2."""
    text = hf_config.get("text_config") or {}
    if text.get("model_type", "qwen2") != "qwen2":
        raise UnsupportedArchitectureError(
            f"InternVL text model {text['model_type']!r} is not supported (supported: qwen2, InternVL3's decoder)"
        )
    hparams = qwen2vl_text.qwen2vl_text_hparams(hf_config)
    parameters = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ("default", "dynamic"):
        raise UnsupportedArchitectureError(f"Qwen2 RoPE type {kind!r} is not supported (supported: default, dynamic)")
    theta = float(parameters.get("rope_theta", hparams["rope_theta"]))
    return hparams | {"rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}


def qwen2_text_config(
    hparams: dict[str, Any], tokenizer: TokenizerMeta, *, image_token_id: int, source_id: str,
    source_config: dict[str, Any],
) -> TextModelConfig:
    """The conduit-rt text config of InternVL3's decoder: a Llama's fields (1-D RoPE), architecture "qwen2"."""
    config = llama_text.llama_text_config(
        hparams, tokenizer, image_token_id=image_token_id, source_id=source_id, source_config=source_config,
    )
    return dataclasses.replace(config, architecture=names.QWEN2_ARCH)


def write_text_model(
    path: Path, config: TextModelConfig, tokenizer: TokenizerMeta, tensors: list[PlannedTensor], *,
    dtype: OutputDtype, model_name: str, source_config_text: str, progress: bool,
) -> Path:
    """``model.gguf`` with llama.cpp's ``qwen2.*`` keys, the tokenizer and the conduit keys."""
    def add_keys(writer: GGUFWriter) -> None:
        llama_text.add_text_keys(writer, config, tokenizer, dtype, model_name)
        writer.add_string(names.ConduitKeys.SOURCE_CONFIG, source_config_text)

    return write_gguf(path, names.QWEN2_ARCH, add_keys, tensors, progress=progress)
