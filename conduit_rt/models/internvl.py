"""InternVL3: InternViT over dynamic tiles -> pixel shuffle + MLP projector -> Qwen2 decoder with 1-D RoPE.

``load(text_path, mmproj_path, device, dtype)`` reads ``model.gguf`` (architecture "qwen2") and,
when given, ``mmproj.gguf`` (projector "internvl") through ``conduit_rt.model_file``; modules are
built on the meta device and take the file's tensors with ``load_state_dict(assign=True)``. Without
an mmproj file this is a plain Qwen2 text model.

An image is cut into tiles (``preprocess_tiles``: the grid closest to its aspect ratio, plus a
thumbnail when there is more than one tile); each tile gives ``tokens_per_tile`` embeddings, in
tile order. The prompt writes an image as ``<img>``, one ``<IMG_CONTEXT>`` per embedding, ``</img>``
(``ModelAssets.image_wrap``), as ``InternVLProcessor`` does; the two wrapping tokens are text. RoPE
positions are the token indices (the decoder is ``llama.LlamaDecoder`` with q/k/v biases, no o_proj
bias, rotate-half RoPE).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from conduit_rt.chat import Prompt
from conduit_rt.errors import ModelFormatError
from conduit_rt.model_config import InternVLVisionConfig, TextModelConfig

from . import internvit, llama
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

IMAGE_START, IMAGE_END = "<img>", "</img>"  # InternVL's fixed image delimiters (llama.cpp writes the same)


class InternVLModel(ArenaVisionLanguageModel):
    """A loaded InternVL3 (see ``base.VisionLanguageModel`` for the contract of each method)."""

    VISION_MODULES = ("vision_tower", "multi_modal_projector")

    def __init__(self, config: ModelConfig, assets: ModelAssets, vision: InternVLVisionConfig | None) -> None:
        super().__init__(config, assets, llama.LlamaDecoder(config, attention_bias=True, output_bias=False))
        self.vision_tower = internvit.InternVisionTower(vision) if vision else None
        self.multi_modal_projector = internvit.InternVLProjector(vision) if vision else None
        self.tokens_per_tile = vision.tokens_per_tile if vision else 0

    def vision_module(self) -> nn.Module | None:
        return self.vision_tower

    def prepare_image(self, rgb: np.ndarray) -> PreparedImage:
        """[H, W, 3] uint8 -> tiles [n_tiles, 3, tile, tile] float32 (computed on demand), n_tiles x tokens_per_tile tokens."""
        self._require_vision()
        params = self.assets.preprocess
        n_tiles = params.n_tiles(rgb.shape[0], rgb.shape[1])
        return PreparedImage(n_tiles * self.tokens_per_tile, params.preprocess, rgb)

    @torch.no_grad()
    def encode_images(self, images: Sequence[PreparedImage]) -> list[torch.Tensor]:
        if not images:
            return []
        features = self.encode_pixels(torch.cat([image.pixel_values for image in images]))
        return list(features.reshape(-1, features.shape[-1]).split([image.n_tokens for image in images]))

    @torch.no_grad()
    def encode_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [n_tiles, 3, tile, tile] -> projected features [n_tiles, tokens_per_tile, hidden]."""
        self._require_tower()
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(self.device, self.dtype)))

    def rope_positions(self, prompt: Prompt, images: Sequence[PreparedImage]) -> torch.Tensor:
        # InternVL numbers image tokens like text: RoPE positions are the token indices.
        return torch.arange(len(prompt.token_ids), dtype=torch.int32)


def model_config(text: TextModelConfig, vision: InternVLVisionConfig | None) -> ModelConfig:
    """The Runtime's view of an InternVL pair of files (tokens per image vary with the tiling: 0 here)."""
    rope = RopeConfig(theta=text.rope_theta, rotary_dim=text.head_dim)
    return decoder_config(
        text, "internvl" if vision else "qwen2", rope, vision_hidden=vision.hidden_size if vision else 0,
        image_size=vision.image_size if vision else 0,
    )


def model_assets(text: TextModelConfig, vision: InternVLVisionConfig | None, mmproj_path: Path | None) -> ModelAssets:
    """Tokenizer, chat template, image preprocessing and the ``<img>`` / ``</img>`` ids stored in the model files."""
    from conduit_rt.preprocess_tiles import TilePreprocessParams

    if vision is None:
        return build_assets(text, None, mmproj_path, None, tokens_per_image=0)
    preprocess = TilePreprocessParams.from_hf_config(
        vision.preprocessor_config or {
            "size": {"height": vision.image_size, "width": vision.image_size},
            "image_mean": list(vision.image_mean), "image_std": list(vision.image_std),
            "min_patches": vision.min_tiles, "max_patches": vision.max_tiles,
        }
    )
    assets = build_assets(text, vision, mmproj_path, preprocess, tokens_per_image=0)
    wrap = tuple(assets.tokenizer.token_to_id(token) for token in (IMAGE_START, IMAGE_END))
    if None in wrap:
        raise ModelFormatError(f"the tokenizer of this InternVL model lacks {IMAGE_START} or {IMAGE_END}")
    return dataclasses.replace(assets, image_wrap=wrap)


def load(
    text_path: str | Path, mmproj_path: str | Path | None, device: torch.device | str, dtype: torch.dtype | None = None,
    *, shard: DecoderShard | None = None,
) -> InternVLModel:
    """Load ``model.gguf`` (+ ``mmproj.gguf``) onto ``device`` in ``dtype`` (default: float32 on CPU,
    bfloat16 on CUDA); with ``shard``, a tensor-parallel rank's share (``models.load_model``). Raises
    ``ModelFormatError`` naming the file and tensor at fault."""
    device, dtype, text_file, vision_file = open_model_files(text_path, mmproj_path, device, dtype)
    text, vision = text_file.config, vision_file.config if vision_file else None
    if vision is not None and not isinstance(vision, InternVLVisionConfig):
        raise ModelFormatError(f"{mmproj_path}: projector {vision.projector_type!r} does not belong to an InternVL model")
    assets = model_assets(text, vision, Path(mmproj_path) if mmproj_path is not None else None)
    model = build_model(lambda config: InternVLModel(config, assets, vision), model_config(text, vision), shard)
    decoder_map = llama.gguf_tensor_map(text.num_hidden_layers, True, text.tie_word_embeddings, output_bias=False)
    assign_decoder(model, text_file, decoder_map, dtype, device, shard)
    if model.vision_module() is not None:
        assign_weights(model.vision_tower, vision_file, internvit.gguf_tensor_map(vision.num_hidden_layers), dtype, device)
        assign_weights(model.multi_modal_projector, vision_file, internvit.projector_tensor_map(), dtype, device)
    model.finish_loading(device, dtype)
    logger.info("loaded %s", model.config)
    return model
