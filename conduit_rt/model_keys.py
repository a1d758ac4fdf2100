"""The hyperparameters a converted GGUF file's keys describe, read into ``model_config`` classes.

``read_text_config`` reads a ``model.gguf``'s ``{arch}.*`` and ``tokenizer.*`` keys,
``read_vision_config`` / ``read_qwen_vision_config`` an ``mmproj.gguf``'s ``clip.*`` keys. Every key
is read through ``KeyReader`` (presence and type checked); counts that size per-layer tables
(block counts) are bounded by the file's tensor count, since each block has tensors of its own, so
that a corrupt count is refused before anything is built from it. The config classes validate
the values themselves (``ValueError``, which the loader turns into ``ModelFormatError``).
"""
from __future__ import annotations

from gguf import Keys

from conduit_rt import gguf_names as names
from conduit_rt.gguf_keys import KeyReader
from conduit_rt.model_config import (MROPE_ARCHITECTURES, InternVLVisionConfig, QwenVisionConfig, TextModelConfig,
                                     VisionModelConfig)


def read_text_config(keys: KeyReader, tensor_names: set[str], arch: str = names.LLAMA_ARCH) -> TextModelConfig:
    """The text hyperparameters and tokenizer from a ``model.gguf``'s keys (``{arch}.*``);
    ``tensor_names``: the file's tensors (the LM head's presence, the bound on the block count)."""

    def key(template: str) -> str:
        return names.llm_key(template, arch)

    tokens = keys.str_list(Keys.Tokenizer.LIST)
    num_heads = keys.int(key(Keys.Attention.HEAD_COUNT))
    hidden = keys.int(key(Keys.LLM.EMBEDDING_LENGTH))
    rope_dims = keys.int(key(Keys.Rope.DIMENSION_COUNT), default=hidden // max(num_heads, 1))
    head_dim = keys.int(key(Keys.Attention.KEY_LENGTH), default=rope_dims)
    scaling = keys.str(key(Keys.Rope.SCALING_TYPE), default="none")
    output = names.tensor_name(names.MODEL_TENSOR.OUTPUT)
    return TextModelConfig(
        architecture=arch,
        vocab_size=keys.int(key(Keys.LLM.VOCAB_SIZE), default=len(tokens)),
        hidden_size=hidden,
        intermediate_size=keys.int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=keys.int(key(Keys.LLM.BLOCK_COUNT), maximum=len(tensor_names)),
        num_attention_heads=num_heads,
        num_key_value_heads=keys.int(key(Keys.Attention.HEAD_COUNT_KV), default=num_heads),
        head_dim=head_dim,
        rms_norm_eps=keys.float(key(Keys.Attention.LAYERNORM_RMS_EPS)),
        rope_theta=keys.float(key(Keys.Rope.FREQ_BASE), default=10000.0),
        rope_scaling_type=None if scaling == "none" else scaling,
        rope_scaling_factor=keys.float(key(Keys.Rope.SCALING_FACTOR), default=1.0),
        max_position_embeddings=keys.int(key(Keys.LLM.CONTEXT_LENGTH)),
        tie_word_embeddings=output not in tensor_names,
        bos_token_id=keys.int(Keys.Tokenizer.BOS_ID),
        eos_token_id=keys.int(Keys.Tokenizer.EOS_ID),
        pad_token_id=keys.int(Keys.Tokenizer.PAD_ID, default=None),
        unk_token_id=keys.int(Keys.Tokenizer.UNK_ID, default=None),
        image_token_id=keys.int(names.ConduitKeys.IMAGE_TOKEN_ID, default=None),
        add_bos_token=keys.bool(Keys.Tokenizer.ADD_BOS, default=True),
        add_eos_token=keys.bool(Keys.Tokenizer.ADD_EOS, default=False),
        tokens=tuple(tokens),
        chat_template=keys.str(Keys.Tokenizer.CHAT_TEMPLATE, default=None),
        tokenizer_json=keys.str(Keys.Tokenizer.HF_JSON),
        source_id=keys.str(names.ConduitKeys.SOURCE_ID, default=""),
        source_config=keys.json(names.ConduitKeys.SOURCE_CONFIG, default={}),
        rope_sections=_rope_sections(keys, key(Keys.Rope.DIMENSION_SECTIONS)) if arch in MROPE_ARCHITECTURES else (),
        eos_token_ids=tuple(keys.int_list(names.ConduitKeys.EOS_TOKEN_IDS, default=[])),
        num_deepstack_layers=keys.int(key(Keys.LLM.NUM_DEEPSTACK_LAYERS), default=0) if arch == names.QWEN3VL_ARCH else 0,
    )


def _rope_sections(keys: KeyReader, key: str) -> tuple[int, ...]:
    """M-RoPE (t, h, w) from ``{arch}.rope.dimension_sections`` (llama.cpp pads it with zeros to 4)."""
    sections = keys.int_list(key)
    if len(sections) < 3 or any(sections[3:]):
        raise ValueError(f"key {key} = {sections}: expected (t, h, w) sections followed by zeros")
    return tuple(sections[:3])


def read_vision_config(keys: KeyReader, n_tensors: int) -> VisionModelConfig:
    """The vision/projector hyperparameters and preprocessing from an ``mmproj.gguf``'s keys
    (``n_tensors``: the file's tensor count, which bounds the block count)."""
    vision = Keys.ClipVision
    use_gelu = keys.bool(vision.USE_GELU, default=False)
    preprocessor = keys.json(names.ConduitKeys.PREPROCESSOR_CONFIG, default={})
    return VisionModelConfig(
        layer_norm_eps=keys.float(vision.Attention.LAYERNORM_EPS),
        hidden_act=keys.str(names.ConduitKeys.VISION_HIDDEN_ACT, default="gelu" if use_gelu else "quick_gelu"),
        feature_layer=keys.int(names.ConduitKeys.FEATURE_LAYER, default=-2),
        feature_select_strategy=keys.str(names.ConduitKeys.FEATURE_SELECT, default="default"),
        **_fixed_size_tower(keys, n_tensors),
        **_preprocessing_and_source(keys, preprocessor),
    )


def read_qwen_vision_config(keys: KeyReader, n_tensors: int) -> QwenVisionConfig:
    """The Qwen2-VL / Qwen2.5-VL tower, merger and preprocessing from an ``mmproj.gguf``'s keys
    (``n_tensors``: the file's tensor count, which bounds the block count)."""
    vision = Keys.ClipVision
    projector = keys.str(Keys.Clip.PROJECTOR_TYPE)
    preprocessor = keys.json(names.ConduitKeys.PREPROCESSOR_CONFIG, default={})
    is_qwen25, is_qwen3 = projector == names.PROJECTOR_QWEN25VL, projector == names.PROJECTOR_QWEN3VL
    default_act = "gelu_pytorch_tanh" if is_qwen3 else "silu" if is_qwen25 else "quick_gelu"
    return QwenVisionConfig(
        projector_type=projector,
        patch_size=keys.int(vision.PATCH_SIZE),
        temporal_patch_size=2,
        spatial_merge_size=keys.int(vision.SPATIAL_MERGE_SIZE, default=2),
        num_channels=3,
        hidden_size=keys.int(vision.EMBEDDING_LENGTH),
        intermediate_size=keys.int(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=keys.int(vision.BLOCK_COUNT, maximum=n_tensors),
        num_attention_heads=keys.int(vision.Attention.HEAD_COUNT),
        layer_norm_eps=keys.float(vision.Attention.LAYERNORM_EPS, default=1e-6),
        hidden_act=keys.str(names.ConduitKeys.VISION_HIDDEN_ACT, default=default_act),
        projection_dim=keys.int(vision.PROJECTION_DIM),
        window_size=keys.int(vision.WINDOW_SIZE, default=112 if is_qwen25 else 0),
        fullatt_block_indexes=_full_attention_blocks(keys, n_tensors) if is_qwen25 else (),
        rope_theta=keys.float(names.ConduitKeys.VISION_ROPE_THETA, default=10000.0),
        **_preprocessing_and_source(keys, preprocessor),
        **(_qwen3_vision_fields(keys, n_tensors) if is_qwen3 else {}),
    )


def read_internvl_vision_config(keys: KeyReader, n_tensors: int) -> InternVLVisionConfig:
    """InternVL's tower, projector and preprocessing from an ``mmproj.gguf``'s keys (``n_tensors``:
    the file's tensor count, which bounds the block count). llama.cpp's files say the tower's
    activation with ``clip.use_gelu`` / ``clip.use_silu`` and have no projector activation key (GELU)."""
    vision = Keys.ClipVision
    preprocessor = keys.json(names.ConduitKeys.PREPROCESSOR_CONFIG, default={})
    default_act = "silu" if keys.bool(vision.USE_SILU, default=False) else "gelu"
    return InternVLVisionConfig(
        layer_norm_eps=keys.float(vision.Attention.LAYERNORM_EPS, default=1e-6),
        hidden_act=keys.str(names.ConduitKeys.VISION_HIDDEN_ACT, default=default_act),
        scale_factor=keys.int(vision.Projector.SCALE_FACTOR, default=2),
        min_tiles=keys.int(vision.PREPROC_MIN_TILES, default=1),
        max_tiles=keys.int(vision.PREPROC_MAX_TILES, default=12),
        **_fixed_size_tower(keys, n_tensors),
        **_preprocessing_and_source(keys, preprocessor),
    )


def _fixed_size_tower(keys: KeyReader, n_tensors: int) -> dict:
    """The fields of a ViT over fixed-size inputs with a projector (LLaVA's CLIP, InternViT's tiles)."""
    vision = Keys.ClipVision
    return {
        "projector_type": keys.str(Keys.Clip.PROJECTOR_TYPE),
        "image_size": keys.int(vision.IMAGE_SIZE),
        "patch_size": keys.int(vision.PATCH_SIZE),
        "num_channels": 3,
        "hidden_size": keys.int(vision.EMBEDDING_LENGTH),
        "intermediate_size": keys.int(vision.FEED_FORWARD_LENGTH),
        "num_hidden_layers": keys.int(vision.BLOCK_COUNT, maximum=n_tensors),
        "num_attention_heads": keys.int(vision.Attention.HEAD_COUNT),
        "projector_hidden_act": keys.str(names.ConduitKeys.PROJECTOR_HIDDEN_ACT, default="gelu"),
        "projection_dim": keys.int(vision.PROJECTION_DIM),
    }


def _qwen3_vision_fields(keys: KeyReader, n_tensors: int) -> dict:
    """Qwen3-VL's learned position grid, (image_size / patch_size)^2 as llama.cpp writes it, and its
    DeepStack blocks (``clip.vision.is_deepstack_layers``, one flag per block)."""
    vision = Keys.ClipVision
    side = keys.int(vision.IMAGE_SIZE) // keys.int(vision.PATCH_SIZE)
    flags = keys.bool_list(vision.IS_DEEPSTACK_LAYERS, default=[])
    if len(flags) > n_tensors:
        raise ValueError(f"key {vision.IS_DEEPSTACK_LAYERS} has {len(flags)} flags, more than the file's tensors")
    return {"num_position_embeddings": side * side,
            "deepstack_visual_indexes": tuple(index for index, flag in enumerate(flags) if flag)}


def _preprocessing_and_source(keys: KeyReader, preprocessor: dict) -> dict:
    """The fields every vision config has: normalization, the processor JSONs, the source's identity."""
    vision = Keys.ClipVision
    return {
        "image_mean": _normalization(keys, preprocessor, "image_mean", vision.IMAGE_MEAN),
        "image_std": _normalization(keys, preprocessor, "image_std", vision.IMAGE_STD),
        "preprocessor_config": preprocessor,
        "processor_config": keys.json(names.ConduitKeys.PROCESSOR_CONFIG, default={}),
        "source_id": keys.str(names.ConduitKeys.SOURCE_ID, default=""),
        "source_config": keys.json(names.ConduitKeys.SOURCE_CONFIG, default={}),
    }


def _normalization(keys: KeyReader, preprocessor: dict, name: str, key: str) -> tuple[float, ...]:
    """``image_mean`` / ``image_std``: the float32 array ``key`` is what llama.cpp reads; the
    preprocessor JSON, when it has ``name``, keeps the exact values and wins."""
    stored = keys.float_list(key)
    value = preprocessor.get(name, stored)
    if not isinstance(value, list) or not all(type(item) in (int, float) for item in value):
        raise ValueError(f"key {names.ConduitKeys.PREPROCESSOR_CONFIG}: {name} must be a list of numbers, "
                         f"found {str(value)[:60]}")
    return tuple(float(item) for item in value)


def _full_attention_blocks(keys: KeyReader, n_tensors: int) -> tuple[int, ...]:
    """``conduit.vision.fullatt_block_indexes``, else llama.cpp's ``clip.vision.n_wa_pattern`` n: blocks
    n-1, 2n-1, ... attend to the whole image, the others within windows."""
    listed = keys.int_list(names.ConduitKeys.FULLATT_BLOCKS, default=None)
    if listed is not None:
        return tuple(listed)
    pattern = keys.int(Keys.ClipVision.N_WA_PATTERN)
    blocks = keys.int(Keys.ClipVision.BLOCK_COUNT, maximum=n_tensors)
    if pattern < 1:
        raise ValueError(f"key {Keys.ClipVision.N_WA_PATTERN} must be positive, got {pattern}")
    return tuple(range(pattern - 1, blocks, pattern))


