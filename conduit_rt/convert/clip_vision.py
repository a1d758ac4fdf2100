"""A CLIP vision tower + LLaVA's 2-layer MLP projector -> ``mmproj.gguf`` (llama.cpp projector "mlp").

Reusable by any LLaVA-style checkpoint with a CLIP ViT: the caller hands over the vision
sub-config, the tower's tensor names relative to ``CLIPVisionTransformer`` (``embeddings.*``,
``encoder.layers.N.*``, ``pre_layrnorm.*``, ...) and the projector's (``linear_1.*``,
``linear_2.*``). Names come from ``gguf.TensorNameMap`` except the projector's: the map says
``mm.1`` for ``linear_1``, while llama.cpp's "mlp" projector loads ``mm.0`` and ``mm.2`` (the
indices of the original LLaVA ``nn.Sequential``), so those two are named here.

As in llama.cpp's LLaVA-1.5 mmproj files, only the blocks up to the feature layer are stored and
the post-layernorm is left out (see ``conduit_rt.gguf_names.clip_mlp_mmproj_tensor_shapes``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from gguf import MODEL_ARCH, MODEL_TENSOR, GGUFWriter, Keys

from .. import gguf_names as names
from ..errors import ModelFormatError, UnsupportedArchitectureError
from ..model_config import VisionModelConfig
from .gguf_output import OutputDtype, PlannedTensor, plan_tensors, write_gguf
from .source import SourceCheckpoint

# transformers' CLIPVisionConfig defaults: old config.json files leave these out.
CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
}
# CLIPImageProcessor's defaults (OpenAI CLIP normalisation).
CLIP_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
_TOWER_PREFIX = "vision_tower.vision_model."  # what gguf.TensorNameMap knows CLIP tensors under
_PROJECTOR_NAMES = {
    f"linear_{hf_index}.{suffix}": names.tensor_name(MODEL_TENSOR.V_MMPROJ, suffix, gguf_index)
    for hf_index, gguf_index in ((1, 0), (2, 2)) for suffix in ("weight", "bias")
}
_UNUSED_TOWER_PREFIXES = ("post_layernorm.", "embeddings.position_ids")  # off the LLaVA feature path


def clip_hparams(hf_vision: dict[str, Any]) -> dict[str, Any]:
    """The vision config with CLIPVisionConfig's defaults filled in; refuses non-CLIP towers."""
    model_type = hf_vision.get("model_type", "clip_vision_model")
    if model_type != "clip_vision_model":
        raise UnsupportedArchitectureError(f"vision tower {model_type!r} is not supported (supported: clip_vision_model)")
    return CLIP_VISION_DEFAULTS | {key: value for key, value in hf_vision.items() if value is not None}


def stored_block_count(num_layers: int, feature_layer: Any) -> int:
    """Blocks whose output LLaVA reads: hidden_states[feature_layer] is the output of this many blocks."""
    if not isinstance(feature_layer, int):
        raise UnsupportedArchitectureError(f"vision_feature_layer {feature_layer!r} is not supported (one layer index only)")
    kept = num_layers + 1 + feature_layer if feature_layer < 0 else feature_layer
    if not 1 <= kept <= num_layers:
        raise ModelFormatError(f"vision_feature_layer {feature_layer} is out of range for {num_layers} vision layers")
    return kept


def image_processor_config(source: SourceCheckpoint) -> dict[str, Any]:
    """preprocessor_config.json, or the ``image_processor`` part of processor_config.json (transformers 5)."""
    preprocessor = source.json_file("preprocessor_config.json")
    if preprocessor is None:
        preprocessor = (source.json_file("processor_config.json") or {}).get("image_processor")
    if preprocessor is None:
        raise ModelFormatError(f"{source.root}: no preprocessor_config.json (the image preprocessing settings)")
    return preprocessor


def clip_vision_config(
    vision: dict[str, Any], *, projection_dim: int, feature_layer: int, feature_select_strategy: str,
    projector_hidden_act: str, preprocessor: dict[str, Any], processor: dict[str, Any], source_id: str,
    source_config: dict[str, Any],
) -> VisionModelConfig:
    """The conduit-rt vision config (validated at construction) for a CLIP tower + MLP projector."""
    return VisionModelConfig(
        projector_type=names.PROJECTOR_MLP, image_size=vision["image_size"], patch_size=vision["patch_size"],
        num_channels=vision["num_channels"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_hidden_layers=stored_block_count(vision["num_hidden_layers"], feature_layer),
        num_attention_heads=vision["num_attention_heads"], layer_norm_eps=float(vision["layer_norm_eps"]),
        hidden_act=vision["hidden_act"], projector_hidden_act=projector_hidden_act, projection_dim=projection_dim,
        feature_layer=feature_layer, feature_select_strategy=feature_select_strategy,
        image_mean=tuple(float(v) for v in preprocessor.get("image_mean", CLIP_IMAGE_MEAN)),
        image_std=tuple(float(v) for v in preprocessor.get("image_std", CLIP_IMAGE_STD)),
        preprocessor_config=preprocessor, processor_config=processor, source_id=source_id, source_config=source_config,
    )


def plan_vision_tensors(
    source: SourceCheckpoint, tower_names: dict[str, str], projector_names: dict[str, str],
    config: VisionModelConfig, dtype: OutputDtype,
) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per mmproj tensor, in ``config.tensor_shapes`` order.

    ``tower_names``/``projector_names`` map names relative to the tower/projector module to the
    names stored in the checkpoint. Blocks past the feature layer and the post-layernorm are skipped.
    """
    name_map = gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, config.num_hidden_layers + 64)
    expected = config.tensor_shapes()
    found: dict[str, str] = {}
    for relative, stored in tower_names.items():
        if relative.startswith(_UNUSED_TOWER_PREFIXES) or _block_index(relative) >= config.num_hidden_layers:
            continue
        gguf_name = name_map.get_name(_TOWER_PREFIX + relative, try_suffixes=(".weight", ".bias"))
        if gguf_name not in expected:
            raise ModelFormatError(f"{source.root}: unexpected vision tensor {stored}")
        found[gguf_name] = stored
    for relative, stored in projector_names.items():
        if relative not in _PROJECTOR_NAMES:
            raise ModelFormatError(f"{source.root}: unexpected projector tensor {stored} (expected linear_1, linear_2)")
        found[_PROJECTOR_NAMES[relative]] = stored
    return plan_tensors(source.root, found, expected, "vision", dtype, source.shape,
                        lambda stored, gguf_name: lambda: source.tensor(stored),
                        quantizable=lambda gguf_name: not gguf_name.startswith("v.position_embd"))


def add_vision_tower_keys(writer: GGUFWriter, config, dtype: OutputDtype, model_name: str, image_size: int) -> None:
    """The ``general.*`` and ``clip.vision.*`` keys every mmproj carries (``config``: a
    VisionModelConfig or QwenVisionConfig; ``image_size``: the one llama.cpp reads)."""
    writer.add_type(names.TYPE_MMPROJ)
    writer.add_name(model_name)
    writer.add_file_type(dtype.file_type)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(config.projector_type)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(config.patch_size)
    writer.add_vision_embedding_length(config.hidden_size)
    writer.add_vision_feed_forward_length(config.intermediate_size)
    writer.add_vision_block_count(config.num_hidden_layers)
    writer.add_vision_head_count(config.num_attention_heads)
    writer.add_vision_attention_layernorm_eps(config.layer_norm_eps)
    writer.add_vision_projection_dim(config.projection_dim)
    writer.add_vision_image_mean(list(config.image_mean))
    writer.add_vision_image_std(list(config.image_std))


def add_mmproj_keys(writer: GGUFWriter, config: VisionModelConfig, dtype: OutputDtype, model_name: str) -> None:
    """llama.cpp's ``clip.*`` keys for an "mlp" projector, plus the conduit keys."""
    add_vision_tower_keys(writer, config, dtype, model_name, config.image_size)
    writer.add_bool(Keys.Clip.HAS_LLAVA_PROJECTOR, True)
    writer.add_vision_use_gelu(config.hidden_act == "gelu")
    keys = names.ConduitKeys
    writer.add_string(keys.VISION_HIDDEN_ACT, config.hidden_act)
    writer.add_string(keys.PROJECTOR_HIDDEN_ACT, config.projector_hidden_act)
    writer.add_int32(keys.FEATURE_LAYER, config.feature_layer)
    writer.add_string(keys.FEATURE_SELECT, config.feature_select_strategy)
    writer.add_string(keys.PREPROCESSOR_CONFIG, json.dumps(config.preprocessor_config))
    writer.add_string(keys.PROCESSOR_CONFIG, json.dumps(config.processor_config))
    writer.add_string(keys.SOURCE_ID, config.source_id)


def write_mmproj(
    path: Path, config: VisionModelConfig, tensors: list[PlannedTensor], *, dtype: OutputDtype,
    model_name: str, source_config_text: str, progress: bool, mmproj_keys=None,
) -> Path:
    """Writes the mmproj file; ``mmproj_keys(writer, config, dtype, model_name)`` adds the family's
    keys (default: the LLaVA projector's, ``add_mmproj_keys``)."""
    def add_keys(writer: GGUFWriter) -> None:
        (mmproj_keys or add_mmproj_keys)(writer, config, dtype, model_name)
        writer.add_string(names.ConduitKeys.SOURCE_CONFIG, source_config_text)

    return write_gguf(path, names.CLIP_ARCH, add_keys, tensors, progress=progress)


def _block_index(relative: str) -> int:
    """N of ``encoder.layers.N.*``; -1 for tensors outside the blocks."""
    parts = relative.split(".")
    return int(parts[2]) if relative.startswith("encoder.layers.") and parts[2].isdigit() else -1
