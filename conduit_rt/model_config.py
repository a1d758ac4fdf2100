"""The hyperparameters of a converted model, one frozen, slotted dataclass per file, validated at construction.

Field names follow Hugging Face's config names so that model code reads like the reference. The
converter builds these from a checkpoint's config.json and writes them as GGUF keys; the loader
reads the keys back into the same classes (``model_file``). Invalid values raise ``ValueError``
(the loader turns it into ``ModelFormatError`` naming the file).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from conduit_rt import gguf_names as names

SUPPORTED_ROPE_SCALING = (None, "linear")
TEXT_ARCHITECTURES = (names.LLAMA_ARCH, names.QWEN2VL_ARCH, names.QWEN2_ARCH, names.QWEN3VL_ARCH)
QWEN2_DECODERS = (names.QWEN2VL_ARCH, names.QWEN2_ARCH)  # q/k/v biases, no o_proj bias
MROPE_ARCHITECTURES = (names.QWEN2VL_ARCH, names.QWEN3VL_ARCH)
VISION_FEATURE_SELECT = ("default", "full")
# InternVL checkpoints tile an image into at most 12 (documents: 40) tiles; the bound keeps a file
# from making each image cost thousands of tower passes.
MAX_TILES = 64


@dataclass(frozen=True, slots=True)
class TextModelConfig:
    """``model.gguf``: a Llama decoder and its tokenizer (``tokenizer_json`` is the whole tokenizer.json).

    ``architecture`` "qwen2vl" is a Qwen2 decoder (a Llama with q/k/v biases) with M-RoPE: its
    ``rope_sections`` (t, h, w) split the rotary frequencies among the three position rows; "qwen2"
    is the same decoder with 1-D RoPE (InternVL3's). "qwen3vl" is a Qwen3 decoder (RMSNorm of each q
    and k head, no biases) whose M-RoPE sections interleave (frequency j turns with h when j % 3 == 1,
    with w when j % 3 == 2, within the sections' extent) and whose first ``num_deepstack_layers``
    layers receive DeepStack features.
    """

    architecture: str  # "llama", "qwen2vl", "qwen2" or "qwen3vl"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int  # H
    num_key_value_heads: int  # H_kv (GQA when < H)
    head_dim: int  # d
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_type: str | None  # None or "linear"
    rope_scaling_factor: float  # positions are divided by this when rope_scaling_type == "linear"
    max_position_embeddings: int
    tie_word_embeddings: bool  # no output.weight: the LM head is token_embd.weight
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int | None
    unk_token_id: int | None
    image_token_id: int | None  # the <image> placeholder token of the chat template
    add_bos_token: bool
    add_eos_token: bool
    tokens: tuple[str, ...]  # tokenizer.ggml.tokens: the piece of each id (len == vocab_size)
    chat_template: str | None  # Jinja template (tokenizer.chat_template)
    tokenizer_json: str  # tokenizer.huggingface.json: the whole tokenizer.json text
    source_id: str  # conduit.source_id; "" when the file was not written by conduit-rt
    source_config: dict[str, Any] = field(default_factory=dict)  # the source's config.json
    rope_sections: tuple[int, ...] = ()  # M-RoPE (t, h, w) frequency counts ("qwen2vl", "qwen3vl")
    num_deepstack_layers: int = 0  # decoder layers whose outputs take DeepStack features ("qwen3vl")
    eos_token_ids: tuple[int, ...] = ()  # further ids that end an answer (generation_config.json)

    def __post_init__(self) -> None:
        _require(self.architecture in TEXT_ARCHITECTURES,
                 f"text architecture {self.architecture!r} is not one of {TEXT_ARCHITECTURES}")
        is_qwen = self.architecture in MROPE_ARCHITECTURES
        _require(not is_qwen or (len(self.rope_sections) == 3 and sum(self.rope_sections) == self.head_dim // 2),
                 f"M-RoPE sections {self.rope_sections} must be 3 counts summing to head_dim / 2 = {self.head_dim // 2}")
        _require(is_qwen or not self.rope_sections, "rope_sections are for the qwen2vl and qwen3vl architectures only")
        _require(0 <= self.num_deepstack_layers <= self.num_hidden_layers
                 and (self.architecture == names.QWEN3VL_ARCH or not self.num_deepstack_layers),
                 f"num_deepstack_layers {self.num_deepstack_layers} must be within the decoder's layers (qwen3vl only)")
        _require_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"))
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}")
        _require(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE")
        _require(self.rms_norm_eps > 0 and self.rope_theta > 0, "rms_norm_eps and rope_theta must be positive")
        _require(self.rope_scaling_type in SUPPORTED_ROPE_SCALING,
                 f"rope scaling {self.rope_scaling_type!r} is not supported (supported: none, linear)")
        _require(self.rope_scaling_factor > 0, "rope_scaling_factor must be positive")
        _require(len(self.tokens) == self.vocab_size,
                 f"tokenizer has {len(self.tokens)} tokens but vocab_size is {self.vocab_size}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "image_token_id"):
            value = getattr(self, name)
            _require(value is None or 0 <= value < self.vocab_size, f"{name} {value} is outside the vocabulary")
        _require(all(0 <= value < self.vocab_size for value in self.eos_token_ids),
                 f"eos_token_ids {self.eos_token_ids} are outside the vocabulary")
        _require(bool(self.tokenizer_json), "tokenizer_json is empty")

    @property
    def num_key_value_groups(self) -> int:
        """G = H / H_kv: query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def tensor_shapes(self, attention_bias: bool = False) -> dict[str, tuple[int, ...]]:
        """GGUF name -> HF-convention shape of every tensor this config implies (see ``gguf_names``).

        ``attention_bias`` adds Llama's q/k/v/o biases; a "qwen2vl" or "qwen2" decoder always has q/k/v
        biases, a "qwen3vl" decoder always has its q/k norms.
        """
        shapes = names.llama_text_tensor_shapes(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_hidden_layers, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if self.architecture in QWEN2_DECODERS:
            shapes |= names.qwen2_attention_bias_shapes(
                num_layers=self.num_hidden_layers, q_rows=self.num_attention_heads * self.head_dim,
                kv_rows=self.num_key_value_heads * self.head_dim,
            )
        elif attention_bias:
            shapes |= names.llama_attention_bias_shapes(
                num_layers=self.num_hidden_layers, hidden_size=self.hidden_size,
                q_rows=self.num_attention_heads * self.head_dim, kv_rows=self.num_key_value_heads * self.head_dim,
            )
        if self.architecture == names.QWEN3VL_ARCH:
            shapes |= names.qwen3_attention_norm_shapes(num_layers=self.num_hidden_layers, head_dim=self.head_dim)
        return shapes


@dataclass(frozen=True, slots=True)
class VisionModelConfig:
    """``mmproj.gguf``: a CLIP ViT and the LLaVA MLP projector, plus the image preprocessing.

    ``num_hidden_layers`` counts the blocks stored in the file, i.e. the blocks that feed the
    projector: run all of them; the output of the last one (no post-layernorm) is HF's
    ``hidden_states[feature_layer]``. Then drop the CLS position if ``feature_select_strategy`` is
    "default" and apply the projector ``mm.2(act(mm.0(x)))``.
    """

    projector_type: str  # "mlp"
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # blocks stored (and run)
    num_attention_heads: int
    layer_norm_eps: float
    hidden_act: str  # ViT MLP activation, e.g. "quick_gelu"
    projector_hidden_act: str  # between mm.0 and mm.2, e.g. "gelu"
    projection_dim: int  # projector output == text hidden_size
    feature_layer: int  # HF vision_feature_layer of the source (informational: see class doc)
    feature_select_strategy: str  # "default" (drop CLS) or "full"
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    preprocessor_config: dict[str, Any]  # the source's preprocessor_config.json (image processor)
    processor_config: dict[str, Any]  # the source's processor_config.json ({} if none)
    source_id: str
    source_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require_positive(self, ("image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads", "projection_dim"))
        _require(self.projector_type == names.PROJECTOR_MLP, f"projector type {self.projector_type!r} is not supported")
        _require(self.image_size % self.patch_size == 0,
                 f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        _require(self.hidden_size % self.num_attention_heads == 0,
                 f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        _require(self.layer_norm_eps > 0, "layer_norm_eps must be positive")
        _require(self.feature_select_strategy in VISION_FEATURE_SELECT,
                 f"feature_select_strategy {self.feature_select_strategy!r} is not one of {VISION_FEATURE_SELECT}")
        _require(len(self.image_mean) == self.num_channels and len(self.image_std) == self.num_channels,
                 f"image_mean/image_std need {self.num_channels} values")
        _require(all(std > 0 for std in self.image_std), "image_std values must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        """Patches per image: (image_size / patch_size)^2."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Positions in the ViT sequence: the patches plus CLS."""
        return self.num_patches + 1

    @property
    def num_image_tokens(self) -> int:
        """Embeddings per image handed to the text model (= <image> tokens after expansion)."""
        return self.num_patches if self.feature_select_strategy == "default" else self.num_positions

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> HF-convention shape of every tensor this config implies (see ``gguf_names``)."""
        return names.clip_mlp_mmproj_tensor_shapes(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_hidden_layers, num_channels=self.num_channels, patch_size=self.patch_size,
            num_positions=self.num_positions, projection_dim=self.projection_dim,
        )


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    """``mmproj.gguf`` of Qwen2-VL ("qwen2vl_merger"), Qwen2.5-VL ("qwen2.5vl_merger") or Qwen3-VL
    ("qwen3vl_merger"), plus preprocessing.

    The tower embeds 14-px patches of 2 frames (Conv3D), runs ``num_hidden_layers`` pre-norm blocks
    with 2-D RoPE (bidirectional attention within each image; Qwen2.5-VL restricts all blocks but
    ``fullatt_block_indexes`` to ``window_size``-pixel windows), then the merger concatenates each
    ``spatial_merge_size``^2 block of patches and projects it to the text width. Qwen3-VL adds a bias
    to the patch embedding and a learned square grid of ``num_position_embeddings`` position
    embeddings (interpolated to each image's grid), and merges the outputs of the
    ``deepstack_visual_indexes`` blocks with mergers of their own (DeepStack features).
    """

    projector_type: str  # "qwen2vl_merger", "qwen2.5vl_merger" or "qwen3vl_merger"
    patch_size: int
    temporal_patch_size: int  # 2 (the Conv3D is stored as two Conv2D slices)
    spatial_merge_size: int
    num_channels: int
    hidden_size: int  # E
    intermediate_size: int  # I
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float
    hidden_act: str  # "quick_gelu" (Qwen2-VL) or "silu" (Qwen2.5-VL, gated)
    projection_dim: int  # merger output == text hidden_size
    window_size: int  # pixels per window side (Qwen2.5-VL); 0 = full attention everywhere
    fullatt_block_indexes: tuple[int, ...]  # blocks with full attention (Qwen2.5-VL)
    rope_theta: float  # base of the 2-D vision RoPE
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    preprocessor_config: dict[str, Any]
    processor_config: dict[str, Any]
    source_id: str
    source_config: dict[str, Any] = field(default_factory=dict)
    num_position_embeddings: int = 0  # Qwen3-VL: learned positions, a square grid
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose outputs feed DeepStack

    def __post_init__(self) -> None:
        _require_positive(self, ("patch_size", "spatial_merge_size", "num_channels", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads", "projection_dim"))
        _require(self.projector_type in (*names.QWEN_PROJECTORS, names.PROJECTOR_QWEN3VL),
                 f"projector type {self.projector_type!r} is not a Qwen merger")
        side = math.isqrt(self.num_position_embeddings)
        _require(not self.is_qwen3 or (side > 0 and side * side == self.num_position_embeddings),
                 f"num_position_embeddings {self.num_position_embeddings} must be a positive square (Qwen3-VL)")
        _require(self.is_qwen3 or not self.deepstack_visual_indexes, "deepstack_visual_indexes are for Qwen3-VL only")
        _require(all(0 <= index < self.num_hidden_layers for index in self.deepstack_visual_indexes)
                 and len(set(self.deepstack_visual_indexes)) == len(self.deepstack_visual_indexes),
                 f"deepstack_visual_indexes {self.deepstack_visual_indexes} must be distinct blocks of the "
                 f"{self.num_hidden_layers}")
        _require(self.temporal_patch_size == 2, f"temporal_patch_size {self.temporal_patch_size} is not supported (2 only)")
        _require(self.hidden_size % self.num_attention_heads == 0 and self.head_dim % 4 == 0,
                 f"vision head_dim {self.hidden_size}/{self.num_attention_heads} must be a multiple of 4 (2-D RoPE)")
        _require(self.layer_norm_eps > 0 and self.rope_theta > 0, "layer_norm_eps and rope_theta must be positive")
        _require(all(0 <= index < self.num_hidden_layers for index in self.fullatt_block_indexes),
                 f"fullatt_block_indexes {self.fullatt_block_indexes} are outside the {self.num_hidden_layers} blocks")
        _require(not self.uses_windows or self.window_size >= self.merge_factor,
                 f"window_size {self.window_size} is smaller than patch_size * spatial_merge_size")
        _require(len(self.image_mean) == self.num_channels and len(self.image_std) == self.num_channels,
                 f"image_mean/image_std need {self.num_channels} values")

    @property
    def is_qwen25(self) -> bool:
        """Qwen2.5-VL: RMSNorm, gated SiLU MLP, window attention."""
        return self.projector_type == names.PROJECTOR_QWEN25VL

    @property
    def is_qwen3(self) -> bool:
        """Qwen3-VL: patch-embedding bias, learned positions, DeepStack mergers."""
        return self.projector_type == names.PROJECTOR_QWEN3VL

    @property
    def uses_windows(self) -> bool:
        return self.is_qwen25 and self.window_size > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_factor(self) -> int:
        """Pixels per merged token side: patch_size * spatial_merge_size."""
        return self.patch_size * self.spatial_merge_size

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> HF-convention shape of every tensor (``gguf_names.qwen_vision_mmproj_tensor_shapes``,
        ``gguf_names.qwen3vl_mmproj_tensor_shapes``)."""
        if self.is_qwen3:
            return names.qwen3vl_mmproj_tensor_shapes(
                hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                num_layers=self.num_hidden_layers, num_channels=self.num_channels, patch_size=self.patch_size,
                merge_size=self.spatial_merge_size, projection_dim=self.projection_dim,
                num_positions=self.num_position_embeddings, deepstack_layers=self.deepstack_visual_indexes,
            )
        return names.qwen_vision_mmproj_tensor_shapes(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_layers=self.num_hidden_layers,
            num_channels=self.num_channels, patch_size=self.patch_size, merge_size=self.spatial_merge_size,
            projection_dim=self.projection_dim, gated_mlp=self.is_qwen25, norm_bias=not self.is_qwen25,
        )


@dataclass(frozen=True, slots=True)
class InternVLVisionConfig:
    """``mmproj.gguf`` of InternVL ("internvl"): InternViT, pixel shuffle and the MLP projector, plus preprocessing.

    Each ``image_size`` tile goes through the ViT (CLS + patches, learned positions, pre-LayerNorm
    blocks with layer scales, no final norm: transformers' ``use_mean_pooling``); the CLS position is
    dropped, each ``scale_factor`` x ``scale_factor`` block of patches is concatenated (pixel shuffle
    by 1 / scale_factor) and ``mm.3(act(mm.1(LayerNorm_mm.0(x))))`` projects it to the text width.
    """

    projector_type: str  # "internvl"
    image_size: int  # tile side
    patch_size: int
    num_channels: int
    hidden_size: int  # E
    intermediate_size: int  # I
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float
    hidden_act: str  # ViT MLP activation ("gelu")
    projector_hidden_act: str  # between mm.1 and mm.3 ("gelu")
    projection_dim: int  # projector output == text hidden_size
    scale_factor: int  # pixel shuffle: 1 / downsample_ratio (2)
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    preprocessor_config: dict[str, Any]
    processor_config: dict[str, Any]
    source_id: str
    source_config: dict[str, Any] = field(default_factory=dict)
    min_tiles: int = 1  # tiles an image is cut into, at least and at most (before the thumbnail);
    max_tiles: int = 12  # the preprocessor JSON's min_patches / max_patches win when it has them

    def __post_init__(self) -> None:
        _require_positive(self, ("image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads", "projection_dim", "scale_factor",
                                 "min_tiles"))
        _require(self.min_tiles <= self.max_tiles <= MAX_TILES,
                 f"tiles per image {self.min_tiles}..{self.max_tiles} must be increasing and at most {MAX_TILES}")
        _require(self.projector_type == names.PROJECTOR_INTERNVL, f"projector type {self.projector_type!r} is not InternVL's")
        _require(self.image_size % (self.patch_size * self.scale_factor) == 0,
                 f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size} x scale_factor {self.scale_factor}")
        _require(self.hidden_size % self.num_attention_heads == 0,
                 f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        _require(self.layer_norm_eps > 0, "layer_norm_eps must be positive")
        _require(len(self.image_mean) == self.num_channels and len(self.image_std) == self.num_channels,
                 f"image_mean/image_std need {self.num_channels} values")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions(self) -> int:
        """Positions in the ViT sequence: the patches of a tile plus CLS."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def tokens_per_tile(self) -> int:
        """Embeddings a tile gives the text model: its patches / scale_factor^2."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> HF-convention shape of every tensor (``gguf_names.internvl_mmproj_tensor_shapes``)."""
        return names.internvl_mmproj_tensor_shapes(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_layers=self.num_hidden_layers,
            num_channels=self.num_channels, patch_size=self.patch_size, num_positions=self.num_positions,
            scale_factor=self.scale_factor, projection_dim=self.projection_dim,
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_positive(config: object, fields: tuple[str, ...]) -> None:
    """Raises ValueError naming the first of ``fields`` of ``config`` that is not > 0."""
    for name in fields:
        _require(getattr(config, name) > 0, f"{name} must be positive, got {getattr(config, name)}")
