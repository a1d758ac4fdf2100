"""The Qwen2-VL / Qwen2.5-VL vision tower and patch merger -> ``mmproj.gguf``, as llama.cpp writes it.

llama.cpp's ``Qwen2VLVisionModel`` conventions, followed here: projector type "qwen2vl_merger"
(Qwen2-VL) or "qwen2.5vl_merger" (Qwen2.5-VL); the fused ``attn.qkv`` weight and bias split into
``attn_q``/``attn_k``/``attn_v`` (rows in thirds); the Conv3D patch embedding [E, C, 2, p, p]
written as its two temporal slices ``v.patch_embd.weight`` and ``v.patch_embd.weight.1``; Qwen2.5-VL's
full-attention blocks as ``clip.vision.n_wa_pattern`` (every n-th block) plus ``clip.vision.use_silu``.
Beyond llama.cpp: the exact ``fullatt_block_indexes`` list, the window size, the vision RoPE base and
the activation are kept as keys, and ``clip.vision.feed_forward_length`` is the MLP's real width
(llama.cpp writes Qwen2-VL's merger width there and reads the width from the tensors).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from gguf import MODEL_ARCH, MODEL_TENSOR, GGUFWriter

from .. import gguf_names as names
from ..errors import ModelFormatError, UnsupportedArchitectureError
from ..model_config import QwenVisionConfig
from ..preprocess import QwenVLPreprocessParams
from . import clip_vision
from .clip_vision import add_vision_tower_keys
from .gguf_output import OutputDtype, PlannedTensor, storage_type, write_gguf
from .source import SourceCheckpoint

# transformers' Qwen2VLVisionConfig and Qwen2_5_VLVisionConfig defaults
QWEN2_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu", "mlp_ratio": 4, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
QWEN25_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
}
LLAMA_CPP_IMAGE_SIZE = 560  # clip.vision.image_size llama.cpp writes for these dynamic-resolution towers
LAYER_NORM_EPS = 1e-6  # transformers hard-codes it for every Qwen vision norm
_PATCH_EMBED = "patch_embed.proj.weight"
_QKV_PARTS = (MODEL_TENSOR.V_ENC_ATTN_Q, MODEL_TENSOR.V_ENC_ATTN_K, MODEL_TENSOR.V_ENC_ATTN_V)


def qwen_vision_config(
    hf_vision: dict[str, Any], *, is_qwen25: bool, text_hidden: int, preprocessor: dict[str, Any],
    processor: dict[str, Any], source_id: str, source_config: dict[str, Any],
) -> QwenVisionConfig:
    """The conduit-rt vision config (validated at construction) from a ``vision_config`` dict."""
    defaults = QWEN25_VISION_DEFAULTS if is_qwen25 else QWEN2_VISION_DEFAULTS
    vision = defaults | {key: value for key, value in hf_vision.items() if value is not None}
    if "in_chans" in hf_vision:  # the hub's original configs
        vision["in_channels"] = hf_vision["in_chans"]
    if is_qwen25:
        hidden, intermediate, projection = vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"]
    else:
        hidden, projection = vision["embed_dim"], vision["hidden_size"]
        intermediate = int(hidden * vision["mlp_ratio"])
    if projection != text_hidden:
        raise ModelFormatError(f"vision merger output {projection} != text hidden_size {text_hidden}")
    rope = vision.get("rope_parameters") or {}
    return QwenVisionConfig(
        projector_type=names.PROJECTOR_QWEN25VL if is_qwen25 else names.PROJECTOR_QWEN2VL,
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        spatial_merge_size=vision["spatial_merge_size"], num_channels=vision["in_channels"], hidden_size=hidden,
        intermediate_size=intermediate, num_hidden_layers=vision["depth"], num_attention_heads=vision["num_heads"],
        layer_norm_eps=LAYER_NORM_EPS, hidden_act=vision["hidden_act"], projection_dim=projection,
        window_size=vision["window_size"] if is_qwen25 else 0,
        fullatt_block_indexes=tuple(vision["fullatt_block_indexes"]) if is_qwen25 else (),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_mean=tuple(float(v) for v in preprocessor.get("image_mean", QwenVLPreprocessParams.image_mean)),
        image_std=tuple(float(v) for v in preprocessor.get("image_std", QwenVLPreprocessParams.image_std)),
        preprocessor_config=preprocessor, processor_config=processor, source_id=source_id, source_config=source_config,
    )


def plan_vision_tensors(
    source: SourceCheckpoint, vision_names: dict[str, str], config: QwenVisionConfig, dtype: OutputDtype,
) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per mmproj tensor, in ``config.tensor_shapes`` order.

    ``vision_names`` maps names relative to the ``visual`` module (``blocks.0.attn.qkv.weight``,
    ``merger.mlp.0.bias``, ...) to the names stored in the checkpoint.
    """
    expected = config.tensor_shapes()
    found: dict[str, PlannedTensor] = {}
    name_map = gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, config.num_hidden_layers + 64)
    for relative, stored in vision_names.items():
        for gguf_name, shape, load in _split(source, relative, stored, name_map):
            if gguf_name not in expected:
                raise ModelFormatError(f"{source.root}: unexpected vision tensor {stored}")
            if shape != expected[gguf_name]:
                raise ModelFormatError(
                    f"{source.root}: tensor {stored} gives {gguf_name} of shape {list(shape)}, expected {list(expected[gguf_name])}"
                )
            found[gguf_name] = PlannedTensor(gguf_name, shape, storage_type(shape, dtype), load)
    missing = [name for name in expected if name not in found]
    if missing:
        raise ModelFormatError(f"{source.root}: missing vision tensor(s) for {', '.join(missing[:5])}")
    return [found[name] for name in expected]


def _split(source: SourceCheckpoint, relative: str, stored: str, name_map: gguf.TensorNameMap):
    """(GGUF name, shape, loader) for each GGUF tensor one stored tensor becomes."""
    shape = source.shape(stored)
    if relative == _PATCH_EMBED:  # Conv3D [E, C, T, p, p] -> one Conv2D slice per frame
        if len(shape) != 5 or shape[2] != 2:
            raise UnsupportedArchitectureError(f"{source.root}: {stored} of shape {list(shape)}: only 2-frame patches are supported")
        frame_shape = (shape[0], shape[1], *shape[3:])
        frame_names = (names.tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH), names.PATCH_EMBD_FRAME_1)
        return [(name, frame_shape, lambda frame=frame: source.tensor(stored)[:, :, frame]) for frame, name in enumerate(frame_names)]
    parts = relative.split(".")
    if len(parts) == 5 and parts[0] == "blocks" and parts[2:4] == ["attn", "qkv"]:  # rows: q, then k, then v
        rows = shape[0] // 3
        return [
            (names.tensor_name(kind, parts[4], int(parts[1])), (rows, *shape[1:]),
             lambda third=third: source.tensor(stored)[third * rows:(third + 1) * rows])
            for third, kind in enumerate(_QKV_PARTS)
        ]
    gguf_name = name_map.get_name("visual." + relative, try_suffixes=(".weight", ".bias"))
    return [(gguf_name, shape, lambda: source.tensor(stored))]


def add_mmproj_keys(writer: GGUFWriter, config: QwenVisionConfig, dtype: OutputDtype, model_name: str) -> None:
    """llama.cpp's ``clip.*`` keys for a Qwen merger, plus the conduit keys."""
    preprocess = QwenVLPreprocessParams.from_hf_config(config.preprocessor_config)
    add_vision_tower_keys(writer, config, dtype, model_name, LLAMA_CPP_IMAGE_SIZE)
    writer.add_vision_spatial_merge_size(config.spatial_merge_size)
    writer.add_vision_min_pixels(preprocess.min_pixels)
    writer.add_vision_max_pixels(preprocess.max_pixels)
    if config.is_qwen25:
        writer.add_vision_use_silu(True)
        writer.add_vision_window_size(config.window_size)
        pattern = _window_pattern(config)
        if pattern is not None:
            writer.add_vision_n_wa_pattern(pattern)
        if config.fullatt_block_indexes:
            writer.add_array(names.ConduitKeys.FULLATT_BLOCKS, list(config.fullatt_block_indexes))
    add_conduit_vision_keys(writer, config)


def add_conduit_vision_keys(writer: GGUFWriter, config: QwenVisionConfig) -> None:
    """The ``conduit.*`` keys of every Qwen tower: activation, RoPE base, processor JSONs, source."""
    keys = names.ConduitKeys
    writer.add_string(keys.VISION_HIDDEN_ACT, config.hidden_act)
    writer.add_float32(keys.VISION_ROPE_THETA, config.rope_theta)
    writer.add_string(keys.PREPROCESSOR_CONFIG, json.dumps(config.preprocessor_config))
    writer.add_string(keys.PROCESSOR_CONFIG, json.dumps(config.processor_config))
    writer.add_string(keys.SOURCE_ID, config.source_id)


def _window_pattern(config: QwenVisionConfig) -> int | None:
    """llama.cpp's n_wa_pattern n (blocks n-1, 2n-1, ... full) when the full blocks follow it, else None."""
    blocks = config.fullatt_block_indexes
    if not blocks:
        return config.num_hidden_layers + 1  # no full-attention block at all
    pattern = blocks[0] + 1
    return pattern if tuple(range(pattern - 1, config.num_hidden_layers, pattern)) == tuple(blocks) else None


def write_mmproj(path: Path, config: QwenVisionConfig, tensors: list[PlannedTensor], **options) -> Path:
    """Writes the mmproj file with the Qwen merger's keys (options: as ``clip_vision.write_mmproj``)."""
    return clip_vision.write_mmproj(path, config, tensors, mmproj_keys=add_mmproj_keys, **options)


__all__ = ["add_conduit_vision_keys", "add_mmproj_keys", "plan_vision_tensors", "qwen_vision_config", "write_mmproj"]
