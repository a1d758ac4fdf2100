"""LLaVA-1.5: CLIP vision tower -> 2-layer MLP projector -> Llama decoder over the native arena.

``load(text_path, mmproj_path, device, dtype)`` reads ``model.gguf`` (and ``mmproj.gguf`` when
given) through ``conduit_rt.model_file``, which validates every key, shape and type; the modules are
built on the meta device and take the file's tensors with ``load_state_dict(assign=True)``, so each
weight exists once, on the target device and in the target dtype.

Image features: the vision tower's feature-layer hidden states (the last block the mmproj stores),
the CLS position dropped ("default" select strategy), then ``linear_2(act(linear_1(x)))``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from conduit_rt.arena import KVArena
from conduit_rt.chat import Prompt
from conduit_rt.errors import ModelFormatError
from conduit_rt.gguf_names import MODEL_TENSOR, tensor_name
from conduit_rt.model_config import TextModelConfig, VisionModelConfig
from conduit_rt.model_file import GGUFModelFile, load_mmproj_file, load_text_model_file

from . import clip, llama
from .base import ForwardBatch, LayerCapture, ModelAssets, ModelConfig, PreparedImage
from .rope import RopeConfig

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LlavaProjector(nn.Module):
    """vision features [.., vision_hidden] -> text embeddings [.., hidden]: linear, activation, linear."""

    def __init__(self, vision_hidden: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)
        self.act = clip.activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def projector_tensor_map() -> dict[str, str]:
    """Parameter name of ``LlavaProjector`` -> GGUF tensor name (llama.cpp's ``mm.0`` / ``mm.2``)."""
    return {
        f"{linear}.{suffix}": tensor_name(MODEL_TENSOR.V_MMPROJ, suffix, index)
        for linear, index in (("linear_1", 0), ("linear_2", 2))
        for suffix in ("weight", "bias")
    }


class LlavaModel(nn.Module):
    """A loaded LLaVA-1.5 (see ``base.VisionLanguageModel`` for the contract of each method)."""

    def __init__(
        self,
        config: ModelConfig,
        assets: ModelAssets,
        text: TextModelConfig,
        vision: VisionModelConfig | None,
        attention_bias: bool,
    ) -> None:
        super().__init__()
        self.config, self.assets = config, assets
        self.language_model = llama.LlamaDecoder(config, attention_bias)
        self.vision_tower = clip.ClipVisionTower(vision) if vision else None
        self.multi_modal_projector = (
            LlavaProjector(vision.hidden_size, text.hidden_size, vision.projector_hidden_act) if vision else None
        )
        self.drop_cls = vision is not None and vision.feature_select_strategy == "default"
        self.device, self.dtype = torch.device("meta"), torch.float32

    @property
    def has_vision(self) -> bool:
        return self.vision_tower is not None

    def new_arena(self, kv_bytes: int, image_cache_bytes: int = 0, block_size: int = 16) -> KVArena:
        c = self.config
        arena = KVArena(
            n_layers=c.n_layers,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            dtype=self.dtype,
            device=self.device,
            block_size=block_size,
            kv_bytes=kv_bytes,
            image_cache_bytes=image_cache_bytes,
        )
        self.language_model.rotary.configure(arena)
        return arena

    @torch.no_grad()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(ids)

    def prepare_image(self, rgb: np.ndarray) -> PreparedImage:
        self._require_vision()
        pixels = torch.from_numpy(self.assets.preprocess.preprocess(rgb))  # [3, crop_h, crop_w] float32
        return PreparedImage(pixel_values=pixels, n_tokens=self.config.tokens_per_image)

    @torch.no_grad()
    def encode_images(self, images: Sequence[PreparedImage]) -> list[torch.Tensor]:
        if not images:
            return []
        batch = torch.stack([image.pixel_values for image in images])
        return list(self.encode_pixels(batch))

    @torch.no_grad()
    def encode_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n_img, 3, H, W] -> projected features [n_img, tokens_per_image, hidden]."""
        self._require_vision()
        features = self.vision_tower(pixel_values.to(self.device, self.dtype))  # [n_img, 1 + patches, v_hidden]
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def rope_positions(self, prompt: Prompt, images: Sequence[PreparedImage]) -> torch.Tensor:
        # LLaVA numbers image tokens like text: RoPE positions are the token indices.
        return torch.arange(len(prompt.token_ids), dtype=torch.int32)

    def _require_vision(self) -> None:
        if self.vision_tower is None:
            raise ModelFormatError("this model was loaded without its mmproj file: it cannot encode images")

    @torch.no_grad()
    def forward(
        self, seq, embeds: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        return self.language_model(seq, embeds, batch, capture)

    @torch.no_grad()
    def forward_layer(
        self, layer: int, seq, x: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """One decoder layer: x [n, hidden] -> [n, hidden]; writes the layer's K, V of the n tokens."""
        return self.language_model.forward_layer(layer, seq, x, batch, capture)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.logits(hidden)


def model_config(text: TextModelConfig, vision: VisionModelConfig | None) -> ModelConfig:
    """The Runtime's view of a LLaVA pair of files."""
    rope = RopeConfig(
        theta=text.rope_theta,
        rotary_dim=text.head_dim,
        scaling_type=text.rope_scaling_type or "default",
        factor=text.rope_scaling_factor,
    )
    return ModelConfig(
        architecture="llava" if vision else "llama",
        n_layers=text.num_hidden_layers,
        n_heads=text.num_attention_heads,
        n_kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        vocab=text.vocab_size,
        rms_norm_eps=text.rms_norm_eps,
        rope=rope,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        image_token_id=text.image_token_id,
        tokens_per_image=vision.num_image_tokens if vision else 0,
        image_size=vision.image_size if vision else 0,
        vision_hidden=vision.hidden_size if vision else 0,
    )


def model_assets(text: TextModelConfig, vision: VisionModelConfig | None, mmproj_path: Path | None) -> ModelAssets:
    """Tokenizer, chat template and image preprocessing stored in the model files."""
    from conduit_rt.chat import ChatTemplate
    from conduit_rt.preprocess import ClipPreprocessParams
    from conduit_rt.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_json_and_ids(
        text.tokenizer_json,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        unk_token_id=text.unk_token_id,
        pad_token_id=text.pad_token_id,
        add_bos_token=text.add_bos_token,
        add_eos_token=text.add_eos_token,
    )
    preprocess, vision_id = None, ""
    if vision is not None:
        side = vision.image_size
        hf_config = vision.preprocessor_config or {
            "size": {"shortest_edge": side},
            "crop_size": {"height": side, "width": side},
            "image_mean": list(vision.image_mean),
            "image_std": list(vision.image_std),
        }
        preprocess = ClipPreprocessParams.from_hf_config(hf_config)
        # Without a source fingerprint, the file itself identifies the vision weights.
        vision_id = (
            vision.source_id
            or hashlib.sha256(f"{mmproj_path.resolve()}:{mmproj_path.stat().st_size}".encode()).hexdigest()
        )
    return ModelAssets(
        tokenizer=tokenizer,
        chat_template=ChatTemplate(text.chat_template) if text.chat_template else None,
        image_token_id=text.image_token_id,
        tokens_per_image=vision.num_image_tokens if vision else 0,
        preprocess=preprocess,
        vision_model_id=vision_id,
        eos_token_ids=frozenset({text.eos_token_id}),
        bos_token_id=text.bos_token_id,
    )


def load(
    text_path: str | Path, mmproj_path: str | Path | None, device: torch.device | str, dtype: torch.dtype | None = None
) -> LlavaModel:
    """Load ``model.gguf`` (+ ``mmproj.gguf``) onto ``device`` in ``dtype`` (default: float32 on CPU,
    bfloat16 on CUDA). Raises ``ModelFormatError`` naming the file and tensor at fault."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported model dtype {dtype}; use one of {SUPPORTED_DTYPES}")
    text_file = load_text_model_file(text_path)
    vision_file = load_mmproj_file(mmproj_path, text_file) if mmproj_path is not None else None
    text, vision = text_file.config, vision_file.config if vision_file else None
    attention_bias = tensor_name(MODEL_TENSOR.ATTN_Q, "bias", 0) in text_file
    assets = model_assets(text, vision, Path(mmproj_path) if mmproj_path is not None else None)
    with torch.device("meta"):
        model = LlavaModel(model_config(text, vision), assets, text, vision, attention_bias)
    _assign(
        model.language_model,
        text_file,
        llama.gguf_tensor_map(text.num_hidden_layers, attention_bias, text.tie_word_embeddings),
        dtype,
        device,
    )
    if vision_file is not None:
        _assign(model.vision_tower, vision_file, clip.gguf_tensor_map(vision.num_hidden_layers), dtype, device)
        _assign(model.multi_modal_projector, vision_file, projector_tensor_map(), dtype, device)
    model.device, model.dtype = device, dtype
    model.language_model.init_rotary(device)
    model.eval().requires_grad_(False)
    logger.info("loaded %s", model.config)
    return model


def _assign(
    module: nn.Module, model_file: GGUFModelFile, mapping: dict[str, str], dtype: torch.dtype, device: torch.device
) -> None:
    """Fill ``module``'s (meta) parameters from the file's tensors, each read once onto ``device``."""
    expected = dict(module.named_parameters(remove_duplicate=False))
    if set(mapping) != set(expected):
        missing, extra = sorted(set(expected) - set(mapping)), sorted(set(mapping) - set(expected))
        raise ModelFormatError(
            f"{model_file.path}: tensor map does not match the module (unmapped {missing[:3]}, unknown {extra[:3]})"
        )
    loaded: dict[str, torch.Tensor] = {}
    for param, gguf_name in mapping.items():
        if gguf_name not in model_file:
            raise ModelFormatError(f"{model_file.path}: missing tensor {gguf_name}")
        shape = model_file.shape(gguf_name)
        if shape != tuple(expected[param].shape):
            raise ModelFormatError(
                f"{model_file.path}: tensor {gguf_name} has shape {list(shape)}, expected {list(expected[param].shape)}"
            )
        if gguf_name not in loaded:  # tied tensors are read once and shared
            loaded[gguf_name] = model_file.tensor(gguf_name, dtype, device)
    module.load_state_dict({param: loaded[name] for param, name in mapping.items()}, strict=True, assign=True)
