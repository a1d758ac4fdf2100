"""LLaVA-1.5: CLIP vision tower -> 2-layer MLP projector -> Llama decoder over the native arena.

``load(text_path, mmproj_path, device, dtype)`` reads ``model.gguf`` (and ``mmproj.gguf`` when
given) through ``conduit_rt.model_file``, which validates every key, shape and type; the modules are
built on the meta device and take the file's tensors with ``load_state_dict(assign=True)``, so each
weight exists once, on the target device and in the target dtype.

Image features: the vision tower's feature-layer hidden states (the last block the mmproj stores),
the CLS position dropped ("default" select strategy), then ``linear_2(act(linear_1(x)))``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from conduit_rt.chat import Prompt
from conduit_rt.gguf_names import MODEL_TENSOR, tensor_name
from conduit_rt.model_config import TextModelConfig, VisionModelConfig

from . import clip, llama
from .arena_model import (
    ArenaVisionLanguageModel,
    assign_decoder,
    assign_weights,
    build_assets,
    build_model,
    decoder_config,
    open_model_files,
)
from .base import ModelAssets, ModelConfig, PreparedImage
from .rope import RopeConfig

if TYPE_CHECKING:
    from conduit_rt.parallel.sharding import DecoderShard

logger = logging.getLogger(__name__)


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


class LlavaModel(ArenaVisionLanguageModel):
    """A loaded LLaVA-1.5 (see ``base.VisionLanguageModel`` for the contract of each method)."""

    VISION_MODULES = ("vision_tower", "multi_modal_projector")

    def __init__(
        self,
        config: ModelConfig,
        assets: ModelAssets,
        text: TextModelConfig,
        vision: VisionModelConfig | None,
        attention_bias: bool,
    ) -> None:
        super().__init__(config, assets, llama.LlamaDecoder(config, attention_bias))
        self.vision_tower = clip.ClipVisionTower(vision) if vision else None
        self.multi_modal_projector = (
            LlavaProjector(vision.hidden_size, text.hidden_size, vision.projector_hidden_act) if vision else None
        )
        self.drop_cls = vision is not None and vision.feature_select_strategy == "default"

    def vision_module(self) -> nn.Module | None:
        return self.vision_tower

    def prepare_image(self, rgb: np.ndarray) -> PreparedImage:
        self._require_vision()
        # pixel_values: [3, crop_h, crop_w] float32, computed when the tower needs them
        return PreparedImage(self.config.tokens_per_image, self.assets.preprocess.preprocess, rgb)

    @torch.no_grad()
    def encode_images(self, images: Sequence[PreparedImage]) -> list[torch.Tensor]:
        if not images:
            return []
        batch = torch.stack([image.pixel_values for image in images])
        return list(self.encode_pixels(batch))

    @torch.no_grad()
    def encode_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n_img, 3, H, W] -> projected features [n_img, tokens_per_image, hidden]."""
        self._require_tower()
        features = self.vision_tower(pixel_values.to(self.device, self.dtype))  # [n_img, 1 + patches, v_hidden]
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def rope_positions(self, prompt: Prompt, images: Sequence[PreparedImage]) -> torch.Tensor:
        # LLaVA numbers image tokens like text: RoPE positions are the token indices.
        return torch.arange(len(prompt.token_ids), dtype=torch.int32)


def model_config(text: TextModelConfig, vision: VisionModelConfig | None) -> ModelConfig:
    """The Runtime's view of a LLaVA pair of files."""
    rope = RopeConfig(
        theta=text.rope_theta,
        rotary_dim=text.head_dim,
        scaling_type=text.rope_scaling_type or "default",
        factor=text.rope_scaling_factor,
    )
    return decoder_config(
        text,
        "llava" if vision else "llama",
        rope,
        vision_hidden=vision.hidden_size if vision else 0,
        tokens_per_image=vision.num_image_tokens if vision else 0,
        image_size=vision.image_size if vision else 0,
    )


def model_assets(text: TextModelConfig, vision: VisionModelConfig | None, mmproj_path: Path | None) -> ModelAssets:
    """Tokenizer, chat template and image preprocessing stored in the model files."""
    from conduit_rt.preprocess import ClipPreprocessParams

    preprocess = None
    if vision is not None:
        side = vision.image_size
        hf_config = vision.preprocessor_config or {
            "size": {"shortest_edge": side},
            "crop_size": {"height": side, "width": side},
            "image_mean": list(vision.image_mean),
            "image_std": list(vision.image_std),
        }
        preprocess = ClipPreprocessParams.from_hf_config(hf_config)
    return build_assets(text, vision, mmproj_path, preprocess, vision.num_image_tokens if vision else 0)


def load(
    text_path: str | Path, mmproj_path: str | Path | None, device: torch.device | str, dtype: torch.dtype | None = None,
    *, shard: DecoderShard | None = None,
) -> LlavaModel:
    """Load ``model.gguf`` (+ ``mmproj.gguf``) onto ``device`` in ``dtype`` (default: float32 on CPU,
    bfloat16 on CUDA); with ``shard``, a tensor-parallel rank's share (``models.load_model``). Raises
    ``ModelFormatError`` naming the file and tensor at fault."""
    device, dtype, text_file, vision_file = open_model_files(text_path, mmproj_path, device, dtype)
    text, vision = text_file.config, vision_file.config if vision_file else None
    attention_bias = tensor_name(MODEL_TENSOR.ATTN_Q, "bias", 0) in text_file
    assets = model_assets(text, vision, Path(mmproj_path) if mmproj_path is not None else None)
    model = build_model(lambda config: LlavaModel(config, assets, text, vision, attention_bias),
                        model_config(text, vision), shard)
    decoder_map = llama.gguf_tensor_map(text.num_hidden_layers, attention_bias, text.tie_word_embeddings)
    assign_decoder(model, text_file, decoder_map, dtype, device, shard)
    if model.vision_module() is not None:
        assign_weights(model.vision_tower, vision_file, clip.gguf_tensor_map(vision.num_hidden_layers), dtype, device)
        assign_weights(model.multi_modal_projector, vision_file, projector_tensor_map(), dtype, device)
    model.finish_loading(device, dtype)
    logger.info("loaded %s", model.config)
    return model
