"""The hyperparameters of a converted model, one frozen, slotted dataclass per file, validated at construction.

Field names follow Hugging Face's config names so that model code reads like the reference. The
converter builds these from a checkpoint's config.json and writes them as GGUF keys; the loader
reads the keys back into the same classes (``model_file``). Invalid values raise ``ValueError``
(the loader turns it into ``ModelFormatError`` naming the file).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conduit_rt import gguf_names as names

SUPPORTED_ROPE_SCALING = (None, "linear")
VISION_FEATURE_SELECT = ("default", "full")


@dataclass(frozen=True, slots=True)
class TextModelConfig:
    """``model.gguf``: a Llama decoder and its tokenizer (``tokenizer_json`` is the whole tokenizer.json)."""

    architecture: str  # "llama"
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
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
        _require(bool(self.tokenizer_json), "tokenizer_json is empty")

    @property
    def num_key_value_groups(self) -> int:
        """G = H / H_kv: query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def tensor_shapes(self, attention_bias: bool = False) -> dict[str, tuple[int, ...]]:
        """GGUF name -> HF-convention shape of every tensor this config implies (see ``gguf_names``)."""
        shapes = names.llama_text_tensor_shapes(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_hidden_layers, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if attention_bias:
            shapes |= names.llama_attention_bias_shapes(
                num_layers=self.num_hidden_layers, hidden_size=self.hidden_size,
                q_rows=self.num_attention_heads * self.head_dim, kv_rows=self.num_key_value_heads * self.head_dim,
            )
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
        for name in ("image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "projection_dim"):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
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


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
