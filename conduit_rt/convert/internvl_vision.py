"""InternVL's InternViT tower and MLP projector -> ``mmproj.gguf``, with llama.cpp's "internvl" names and keys.

llama.cpp's ``InternVisionModel`` conventions, followed here: projector type "internvl", the
pixel-shuffle factor as ``clip.vision.projector.scale_factor`` (1 / downsample_ratio), the tower's
activation as ``clip.use_gelu``, the layer scales as ``v.blk.N.ls1/ls2.weight`` and the projector as
``mm.0`` (LayerNorm), ``mm.1`` and ``mm.3`` (the indices of the original ``mlp1`` Sequential).
The tile limits go in llama.cpp's ``clip.vision.preproc_{min,max}_tiles``. Beyond llama.cpp: the
activations and the image processor's JSON are kept as ``conduit.*`` keys. Tensor names come from
transformers' ``InternVLVisionModel`` (``embeddings.*``, ``encoder.layer.N.*``) and
``InternVLMultiModalProjector`` (``layer_norm``, ``linear_1``, ``linear_2``).

Supported: the InternViT-300M tower of InternVL3-1B..14B (LayerNorm, no q/k norm, absolute position
embeddings, no final norm); the InternViT-6B variant (RMSNorm with q/k norm) is refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import MODEL_TENSOR, GGUFWriter

from .. import gguf_names as names
from ..errors import ModelFormatError, UnsupportedArchitectureError
from ..model_config import InternVLVisionConfig
from ..preprocess_tiles import IMAGENET_MEAN, IMAGENET_STD, TilePreprocessParams
from . import clip_vision
from .clip_vision import add_vision_tower_keys
from .gguf_output import OutputDtype, PlannedTensor, plan_tensors
from .source import SourceCheckpoint

# transformers' InternVLVisionConfig defaults
INTERNVL_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "attention_bias": False,
    "use_qk_norm": False, "intermediate_size": 4096, "hidden_act": "gelu", "norm_type": "layer_norm",
    "layer_norm_eps": 1e-6, "image_size": 448, "patch_size": 14, "num_channels": 3,
    "use_absolute_position_embeddings": True, "use_mean_pooling": True,
}
_BLOCK_NAMES = {  # name inside encoder.layer.N -> (GGUF tensor kind, suffix)
    "layernorm_before.weight": (MODEL_TENSOR.V_ENC_INPUT_NORM, "weight"),
    "layernorm_before.bias": (MODEL_TENSOR.V_ENC_INPUT_NORM, "bias"),
    "layernorm_after.weight": (MODEL_TENSOR.V_ENC_POST_ATTN_NORM, "weight"),
    "layernorm_after.bias": (MODEL_TENSOR.V_ENC_POST_ATTN_NORM, "bias"),
    "lambda_1": (MODEL_TENSOR.V_LAYER_SCALE_1, "weight"),
    "lambda_2": (MODEL_TENSOR.V_LAYER_SCALE_2, "weight"),
    **{f"{module}.{suffix}": (kind, suffix) for module, kind in (
        ("attention.q_proj", MODEL_TENSOR.V_ENC_ATTN_Q), ("attention.k_proj", MODEL_TENSOR.V_ENC_ATTN_K),
        ("attention.v_proj", MODEL_TENSOR.V_ENC_ATTN_V), ("attention.projection_layer", MODEL_TENSOR.V_ENC_ATTN_O),
        ("mlp.fc1", MODEL_TENSOR.V_ENC_FFN_UP), ("mlp.fc2", MODEL_TENSOR.V_ENC_FFN_DOWN),
    ) for suffix in ("weight", "bias")},
}
_EMBEDDING_NAMES = {
    "embeddings.patch_embeddings.projection.weight": names.tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH),
    "embeddings.patch_embeddings.projection.bias": names.tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH, "bias"),
    "embeddings.cls_token": names.tensor_name(MODEL_TENSOR.V_ENC_EMBD_CLS, suffix=None),
    "embeddings.position_embeddings": names.tensor_name(MODEL_TENSOR.V_ENC_EMBD_POS),
}
_PROJECTOR_NAMES = {
    f"{module}.{suffix}": names.tensor_name(MODEL_TENSOR.V_MMPROJ, suffix, index)
    for module, index in (("layer_norm", 0), ("linear_1", 1), ("linear_2", 3)) for suffix in ("weight", "bias")
}


def internvl_vision_config(
    source: SourceCheckpoint, *, text_hidden: int, preprocessor: dict[str, Any], processor: dict[str, Any],
    source_id: str,
) -> InternVLVisionConfig:
    """The conduit-rt vision config (validated at construction) from an ``InternVLConfig``; refuses
    what the runtime does not run, naming the setting."""
    top = source.config
    vision = INTERNVL_VISION_DEFAULTS | {k: v for k, v in (top.get("vision_config") or {}).items() if v is not None}
    unsupported = {
        "norm_type": vision["norm_type"] != "layer_norm", "use_qk_norm": bool(vision["use_qk_norm"]),
        "use_absolute_position_embeddings": not vision["use_absolute_position_embeddings"],
        "vision_feature_select_strategy": top.get("vision_feature_select_strategy", "default") != "default",
        "use_mean_pooling": not vision["use_mean_pooling"] and top.get("vision_feature_layer", -1) == -1,
        "attention_bias": not vision["attention_bias"],
    }
    refused = [name for name, bad in unsupported.items() if bad]
    if refused:
        raise UnsupportedArchitectureError(
            f"{source.root}: InternVL vision settings {', '.join(refused)} are not supported "
            "(supported: the LayerNorm InternViT with q/k/v biases and no q/k norm, CLS dropped, no final norm)"
        )
    side, patch = _square(vision["image_size"], "image_size"), _square(vision["patch_size"], "patch_size")
    tiles = TilePreprocessParams.from_hf_config(preprocessor)
    ratio = float(top.get("downsample_ratio", 0.5))
    if ratio <= 0 or abs(1 / ratio - round(1 / ratio)) > 1e-6:
        raise UnsupportedArchitectureError(f"{source.root}: downsample_ratio {ratio} is not 1 / an integer")
    config = InternVLVisionConfig(
        projector_type=names.PROJECTOR_INTERNVL, image_size=side, patch_size=patch,
        num_channels=vision["num_channels"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_hidden_layers=clip_vision.stored_block_count(vision["num_hidden_layers"], top.get("vision_feature_layer", -1)),
        num_attention_heads=vision["num_attention_heads"], layer_norm_eps=float(vision["layer_norm_eps"]),
        hidden_act=vision["hidden_act"], projector_hidden_act=top.get("projector_hidden_act", "gelu"),
        projection_dim=text_hidden, scale_factor=round(1 / ratio),
        image_mean=tuple(float(v) for v in preprocessor.get("image_mean", IMAGENET_MEAN)),
        image_std=tuple(float(v) for v in preprocessor.get("image_std", IMAGENET_STD)),
        preprocessor_config=preprocessor, processor_config=processor, source_id=source_id, source_config=top,
        min_tiles=tiles.min_patches, max_tiles=tiles.max_patches,
    )
    stated = processor.get("image_seq_length", top.get("image_seq_length"))
    if stated is not None and stated != config.tokens_per_tile:
        raise ModelFormatError(
            f"{source.root}: image_seq_length {stated} != the {config.tokens_per_tile} tokens a {side}-px tile gives "
            f"({patch}-px patches, pixel shuffle by {config.scale_factor})"
        )
    return config


def _square(value: Any, name: str) -> int:
    """An int, or a [height, width] pair of equal sides (transformers stores both as pairs)."""
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or sides[0] != sides[1]:
        raise UnsupportedArchitectureError(f"InternVL vision {name} {value!r} is not square")
    return int(sides[0])


def plan_vision_tensors(
    source: SourceCheckpoint, tower_names: dict[str, str], projector_names: dict[str, str],
    config: InternVLVisionConfig, dtype: OutputDtype,
) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per mmproj tensor, in ``config.tensor_shapes`` order. ``tower_names`` /
    ``projector_names`` map names relative to the tower / projector module to the stored names;
    blocks past the feature layer are skipped, anything unknown is refused."""
    found: dict[str, str] = {}
    for relative, stored in tower_names.items():
        gguf_name = _tower_gguf_name(relative, config.num_hidden_layers)
        if gguf_name is None:
            raise ModelFormatError(f"{source.root}: unexpected vision tensor {stored}")
        if gguf_name:
            found[gguf_name] = stored
    for relative, stored in projector_names.items():
        if relative not in _PROJECTOR_NAMES:
            raise ModelFormatError(f"{source.root}: unexpected projector tensor {stored}")
        found[_PROJECTOR_NAMES[relative]] = stored
    return plan_tensors(source.root, found, config.tensor_shapes(), "vision", dtype, source.shape,
                        lambda stored, gguf_name: lambda: source.tensor(stored),
                        quantizable=lambda gguf_name: not gguf_name.startswith(("v.position_embd", "v.patch_embd")))


def _tower_gguf_name(relative: str, n_layers: int) -> str | None:
    """The GGUF name of a tower tensor, "" for a block past the feature layer, None when unknown."""
    if relative in _EMBEDDING_NAMES:
        return _EMBEDDING_NAMES[relative]
    parts = relative.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[2].isdigit() and parts[3] in _BLOCK_NAMES:
        layer = int(parts[2])
        kind, suffix = _BLOCK_NAMES[parts[3]]
        return names.tensor_name(kind, suffix, layer) if layer < n_layers else ""
    return None


def add_mmproj_keys(writer: GGUFWriter, config: InternVLVisionConfig, dtype: OutputDtype, model_name: str) -> None:
    """llama.cpp's ``clip.*`` keys for the "internvl" projector, plus the conduit keys."""
    add_vision_tower_keys(writer, config, dtype, model_name, config.image_size)
    writer.add_vision_projector_scale_factor(config.scale_factor)
    writer.add_vision_use_gelu(config.hidden_act == "gelu")
    writer.add_vision_use_silu(config.hidden_act == "silu")
    writer.add_vision_preproc_min_tiles(config.min_tiles)
    writer.add_vision_preproc_max_tiles(config.max_tiles)
    keys = names.ConduitKeys
    writer.add_string(keys.VISION_HIDDEN_ACT, config.hidden_act)
    writer.add_string(keys.PROJECTOR_HIDDEN_ACT, config.projector_hidden_act)
    writer.add_string(keys.PREPROCESSOR_CONFIG, json.dumps(config.preprocessor_config))
    writer.add_string(keys.PROCESSOR_CONFIG, json.dumps(config.processor_config))
    writer.add_string(keys.SOURCE_ID, config.source_id)


def write_mmproj(path: Path, config: InternVLVisionConfig, tensors: list[PlannedTensor], **options) -> Path:
    """Writes the mmproj file with InternVL's keys (options: as ``clip_vision.write_mmproj``)."""
    return clip_vision.write_mmproj(path, config, tensors, mmproj_keys=add_mmproj_keys, **options)


__all__ = ["add_mmproj_keys", "internvl_vision_config", "plan_vision_tensors", "write_mmproj"]
