"""Qwen3-VL (``Qwen3VLForConditionalGeneration``) -> ``model.gguf`` + ``mmproj.gguf``, as llama.cpp writes them.

Text (llama.cpp architecture "qwen3vl", written by ``qwen2vl_text``): a Qwen3 decoder, tensors as stored (no row permutation:
the RoPE is rotate-half), ``blk.N.attn_{q,k}_norm`` for the per-head q/k RMSNorm, the M-RoPE
sections as ``qwen3vl.rope.dimension_sections`` padded to four entries (the interleaving is implied
by the architecture) and ``qwen3vl.n_deepstack_layers``. Vision (projector "qwen3vl_merger"): the
tower with its fused ``attn_qkv``, the Conv3D patch embedding as two temporal slices plus its bias,
the learned positions ``v.position_embd``, the merger as ``v.post_ln`` / ``mm.0`` / ``mm.2``, and each
DeepStack merger as ``v.deepstack.N.*`` numbered by the block it reads, flagged in
``clip.vision.is_deepstack_layers``. llama.cpp derives the position grid from ``clip.vision.image_size``
(side = image_size / patch_size), which is written accordingly. Beyond llama.cpp: the vision
activation and RoPE base, the preprocessor JSON and the source fingerprint (``conduit.*`` keys).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gguf import MODEL_TENSOR, GGUFWriter

from .. import gguf_names as names
from ..errors import ModelFormatError, UnsupportedArchitectureError
from ..model_config import QwenVisionConfig
from ..preprocess import QwenVLPreprocessParams
from . import clip_vision, parts, qwen2vl_text
from .clip_vision import add_vision_tower_keys, image_processor_config
from .gguf_output import ConvertedFiles, OutputDtype, PlannedTensor, storage_type
from .qwen2vl_vision import add_conduit_vision_keys
from .source import SourceCheckpoint
from .tokenizer_meta import read_model_tokenizer

HF_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
DESCRIPTION = ("Qwen3-VL: ViT with learned + 2-D RoPE positions and DeepStack mergers, 2x2 merger, "
               "Qwen3 decoder with interleaved M-RoPE and q/k norms")
DEFAULT_IMAGE_TOKEN_ID = 151655  # <|image_pad|>
# transformers' Qwen3VLTextConfig / Qwen3VLVisionConfig defaults (hub configs spell most of them out)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": None,
}
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
}
LAYER_NORM_EPS = 1e-6  # transformers hard-codes it for every Qwen3-VL vision norm
_PARTS = {  # stored-name prefix -> (part, prefix of the name inside that part)
    "model.language_model.": ("text", "model."),
    "model.visual.": ("vision", ""),
    "visual.": ("vision", ""),
    "lm_head.": ("text", "lm_head."),
}
_PATCH_EMBED = "patch_embed.proj.weight"


def convert(source: SourceCheckpoint, outdir: Path, dtype: OutputDtype, *, progress: bool = True) -> ConvertedFiles:
    """Write ``outdir/model.gguf`` and ``outdir/mmproj.gguf`` from a Qwen3-VL checkpoint."""
    tensors = parts.split_parts(source, _PARTS, "Qwen3-VL")
    hparams = parts.build_config(source, lambda: text_hparams(source.config))
    tokenizer = read_model_tokenizer(source, tensors["text"], hparams, "model.language_model.embed_tokens.weight")
    source_id = source.fingerprint()
    vision_hf = VISION_DEFAULTS | {k: v for k, v in (source.config.get("vision_config") or {}).items() if v is not None}
    text_config = parts.build_config(source, lambda: qwen2vl_text.qwen2vl_text_config(
        hparams, tokenizer, image_token_id=int(source.config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)),
        source_id=source_id, source_config=source.config, architecture=names.QWEN3VL_ARCH,
        num_deepstack_layers=len(vision_hf["deepstack_visual_indexes"]),
    ))
    text_tensors = qwen2vl_text.plan_text_tensors(source, tensors["text"], text_config, dtype)
    vision_config = parts.build_config(source, lambda: qwen3_vision_config(
        vision_hf, text_hidden=text_config.hidden_size, preprocessor=image_processor_config(source),
        processor=parts.processor_settings(source), source_id=source_id, source_config=source.config,
    ))
    vision_tensors = plan_vision_tensors(source, tensors["vision"], vision_config, dtype)

    outdir.mkdir(parents=True, exist_ok=True)
    common = {"dtype": dtype, "model_name": source.name, "source_config_text": source.config_text, "progress": progress}
    text_path = qwen2vl_text.write_text_model(outdir / names.TEXT_FILE_NAME, text_config, tokenizer, text_tensors, **common)
    mmproj_path = clip_vision.write_mmproj(outdir / names.MMPROJ_FILE_NAME, vision_config, vision_tensors,
                                           mmproj_keys=add_mmproj_keys, **common)
    return ConvertedFiles(text_model=text_path, mmproj=mmproj_path)


def text_hparams(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's hyperparameters (``text_config``, defaults filled in); refuses what the runtime cannot run."""
    text = hf_config.get("text_config") or {}
    hparams = TEXT_DEFAULTS | {key: value for key, value in text.items() if value is not None}
    hparams["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    if hparams["hidden_act"] != "silu":
        raise UnsupportedArchitectureError(f"Qwen3 decoder with hidden_act={hparams['hidden_act']!r} is not supported")
    if hparams["attention_bias"]:
        raise UnsupportedArchitectureError("Qwen3 decoder with attention_bias=true is not supported")
    hparams["num_key_value_heads"] = hparams["num_key_value_heads"] or hparams["num_attention_heads"]
    return hparams


def qwen3_vision_config(
    vision: dict[str, Any], *, text_hidden: int, preprocessor: dict[str, Any], processor: dict[str, Any],
    source_id: str, source_config: dict[str, Any],
) -> QwenVisionConfig:
    """The conduit-rt vision config (validated at construction) from a ``vision_config`` dict with defaults."""
    if vision["out_hidden_size"] != text_hidden:
        raise ModelFormatError(f"vision merger output {vision['out_hidden_size']} != text hidden_size {text_hidden}")
    rope = vision.get("rope_parameters") or {}
    return QwenVisionConfig(
        projector_type=names.PROJECTOR_QWEN3VL, patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"], spatial_merge_size=vision["spatial_merge_size"],
        num_channels=vision["in_channels"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_hidden_layers=vision["depth"],
        num_attention_heads=vision["num_heads"], layer_norm_eps=LAYER_NORM_EPS, hidden_act=vision["hidden_act"],
        projection_dim=vision["out_hidden_size"], window_size=0, fullatt_block_indexes=(),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_mean=tuple(float(v) for v in preprocessor.get("image_mean", QwenVLPreprocessParams.image_mean)),
        image_std=tuple(float(v) for v in preprocessor.get("image_std", QwenVLPreprocessParams.image_std)),
        preprocessor_config=preprocessor, processor_config=processor, source_id=source_id, source_config=source_config,
        num_position_embeddings=vision["num_position_embeddings"],
        deepstack_visual_indexes=tuple(vision["deepstack_visual_indexes"]),
    )


def plan_vision_tensors(
    source: SourceCheckpoint, vision_names: dict[str, str], config: QwenVisionConfig, dtype: OutputDtype,
) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per mmproj tensor, in ``config.tensor_shapes`` order; ``vision_names`` maps
    names relative to the ``visual`` module to the stored names."""
    expected = config.tensor_shapes()
    found: dict[str, PlannedTensor] = {}
    for relative, stored in vision_names.items():
        for gguf_name, shape, load in _vision_tensors(source, relative, stored, config):
            if shape != expected[gguf_name]:
                raise ModelFormatError(f"{source.root}: tensor {stored} gives {gguf_name} of shape {list(shape)}, "
                                       f"expected {list(expected[gguf_name])}")
            found[gguf_name] = PlannedTensor(gguf_name, shape, storage_type(shape, dtype), load)
    missing = [name for name in expected if name not in found]
    if missing:
        raise ModelFormatError(f"{source.root}: missing vision tensor(s) for {', '.join(missing[:5])}")
    return [found[name] for name in expected]


def _vision_tensors(source: SourceCheckpoint, relative: str, stored: str, config: QwenVisionConfig):
    """(GGUF name, shape, loader) of each GGUF tensor one stored vision tensor becomes."""
    shape = source.shape(stored)
    if relative == _PATCH_EMBED:  # Conv3D [E, C, T, p, p] -> one Conv2D slice per frame
        if len(shape) != 5 or shape[2] != 2:
            raise UnsupportedArchitectureError(f"{source.root}: {stored} of shape {list(shape)}: only 2-frame patches are supported")
        frame_names = (names.tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH), names.PATCH_EMBD_FRAME_1)
        return [(name, (shape[0], shape[1], *shape[3:]), lambda frame=frame: source.tensor(stored)[:, :, frame])
                for frame, name in enumerate(frame_names)]
    gguf_name = names.qwen3vl_vision_tensor_name(relative, config.deepstack_visual_indexes)
    if gguf_name is None or gguf_name not in config.tensor_shapes():
        raise ModelFormatError(f"{source.root}: unexpected vision tensor {stored}")
    return [(gguf_name, shape, lambda: source.tensor(stored))]


def add_mmproj_keys(writer: GGUFWriter, config: QwenVisionConfig, dtype: OutputDtype, model_name: str) -> None:
    """llama.cpp's ``clip.*`` keys for the "qwen3vl_merger" projector, plus the conduit keys."""
    preprocess = QwenVLPreprocessParams.from_hf_config(config.preprocessor_config)
    add_vision_tower_keys(writer, config, dtype, model_name, math.isqrt(config.num_position_embeddings) * config.patch_size)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(config.spatial_merge_size)
    writer.add_vision_min_pixels(preprocess.min_pixels)
    writer.add_vision_max_pixels(preprocess.max_pixels)
    deepstack = set(config.deepstack_visual_indexes)
    writer.add_vision_is_deepstack_layers([block in deepstack for block in range(config.num_hidden_layers)])
    add_conduit_vision_keys(writer, config)


__all__ = ["DESCRIPTION", "HF_ARCHITECTURE", "convert", "plan_vision_tensors", "qwen3_vision_config", "text_hparams"]
