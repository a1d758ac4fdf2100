"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution vision tower + merger -> Qwen2 decoder with M-RoPE.

``load(text_path, mmproj_path, device, dtype)`` reads ``model.gguf`` (architecture "qwen2vl") and
``mmproj.gguf`` (projector "qwen2vl_merger" or "qwen2.5vl_merger") through ``conduit_rt.model_file``;
modules are built on the meta device and take the file's tensors with ``load_state_dict(assign=True)``.

The decoder is ``llama.LlamaDecoder`` with q/k/v biases, no o_proj bias and M-RoPE: each token has
three RoPE positions (t, h, w) and the rotary frequencies are split in ``rope_sections`` among them.
The native arena rotates K with the same sections (``KVArena.set_rope(..., "mrope")``). Positions are
transformers' ``get_rope_index``: text tokens count up on all three rows; an image's tokens sit on
their merged grid (t, row, column) offset by the position where the image starts, and the text after
it resumes at that start + max(rows, columns). Attention masks stay causal by token index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from conduit_rt.chat import Prompt, Segment, TextRun
from conduit_rt.errors import ModelFormatError
from conduit_rt.model_config import QwenVisionConfig, TextModelConfig

from . import llama, qwen2vl_vision
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


def mrope_positions(
    segments: Sequence[Segment], grids: Sequence[tuple[int, int, int]], merge_size: int
) -> torch.Tensor:
    """M-RoPE positions int32 [3, n] of a prompt's segments, as transformers' ``get_rope_index``.

    grids: the (t, h, w) patch grid of each image (indexed by ``ImageSlot.image_index``).
    """
    rows, start = [], 0
    for segment in segments:
        if isinstance(segment, TextRun):
            rows.append((torch.arange(segment.n_tokens) + start).expand(3, -1))
            start += segment.n_tokens
            continue
        t, h, w = grids[segment.image_index]
        h, w = h // merge_size, w // merge_size
        if t * h * w != segment.n_tokens:
            raise ValueError(f"image slot of {segment.n_tokens} tokens does not fit the merged grid {t}x{h}x{w}")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        rows.append(grid.reshape(3, -1) + start)
        start += max(h, w)
    if not rows:
        return torch.zeros(3, 0, dtype=torch.int32)
    return torch.cat(rows, dim=1).to(torch.int32)


class Qwen2VLModel(ArenaVisionLanguageModel):
    """A loaded Qwen2-VL / Qwen2.5-VL (see ``base.VisionLanguageModel`` for the contract of each method)."""

    VISION_MODULES = ("visual",)

    def __init__(self, config: ModelConfig, assets: ModelAssets, vision: QwenVisionConfig | None) -> None:
        super().__init__(config, assets, llama.LlamaDecoder(config, attention_bias=True, output_bias=False))
        self.visual = qwen2vl_vision.QwenVisionTower(vision) if vision else None
        self.merge_size = vision.spatial_merge_size if vision else 1

    def vision_module(self) -> nn.Module | None:
        return self.visual

    def prepare_image(self, rgb: np.ndarray) -> PreparedImage:
        """[H, W, 3] uint8 -> patches [t*h*w, 3*2*p*p] float32, (t*h*w) / merge^2 tokens, grid (t, h, w)."""
        self._require_vision()
        params = self.assets.preprocess
        grid = params.grid_thw(rgb.shape[0], rgb.shape[1])
        return PreparedImage(int(np.prod(grid)) // self.merge_size**2, params.preprocess, rgb, grid_thw=grid)

    @torch.no_grad()
    def encode_images(self, images: Sequence[PreparedImage]) -> list[torch.Tensor]:
        if not images:
            return []
        features = self.encode_pixels(
            torch.cat([image.pixel_values for image in images]), [image.grid_thw for image in images]
        )
        return list(features.split([image.n_tokens for image in images]))

    @torch.no_grad()
    def encode_pixels(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Patches of several images [sum t*h*w, 3*2*p*p] and their grids -> [sum tokens, hidden], image order."""
        self._require_tower()
        grids = [tuple(int(v) for v in grid) for grid in grids]
        return self.visual(pixel_values.to(self.device, self.dtype), grids)

    def rope_positions(self, prompt: Prompt, images: Sequence[PreparedImage]) -> torch.Tensor:
        grids = [image.grid_thw for image in images]
        return mrope_positions(prompt.segments, grids, self.merge_size)


def model_config(text: TextModelConfig, vision: QwenVisionConfig | None) -> ModelConfig:
    """The Runtime's view of a Qwen2-VL pair of files (tokens per image vary: 0 here)."""
    architecture = "qwen2vl" if vision is None or not vision.is_qwen25 else "qwen2.5vl"
    rope = RopeConfig(theta=text.rope_theta, rotary_dim=text.head_dim, sections=text.rope_sections)
    return decoder_config(text, architecture, rope, vision_hidden=vision.hidden_size if vision else 0)


def model_assets(text: TextModelConfig, vision: QwenVisionConfig | None, mmproj_path: Path | None) -> ModelAssets:
    """Tokenizer, chat template and image preprocessing stored in the model files."""
    from conduit_rt.preprocess import QwenVLPreprocessParams

    preprocess = None
    if vision is not None:
        preprocess = QwenVLPreprocessParams.from_hf_config(
            vision.preprocessor_config
            or {
                "patch_size": vision.patch_size,
                "merge_size": vision.spatial_merge_size,
                "image_mean": list(vision.image_mean),
                "image_std": list(vision.image_std),
            }
        )
    return build_assets(text, vision, mmproj_path, preprocess, tokens_per_image=0)


def load(
    text_path: str | Path, mmproj_path: str | Path | None, device: torch.device | str, dtype: torch.dtype | None = None,
    *, shard: DecoderShard | None = None,
) -> Qwen2VLModel:
    """Load ``model.gguf`` (+ ``mmproj.gguf``) onto ``device`` in ``dtype`` (default: float32 on CPU,
    bfloat16 on CUDA); with ``shard``, a tensor-parallel rank's share (``models.load_model``). Raises
    ``ModelFormatError`` naming the file and tensor at fault."""
    device, dtype, text_file, vision_file = open_model_files(text_path, mmproj_path, device, dtype)
    text, vision = text_file.config, vision_file.config if vision_file else None
    if vision is not None and not isinstance(vision, QwenVisionConfig):
        raise ModelFormatError(
            f"{mmproj_path}: projector {vision.projector_type!r} does not belong to a Qwen2-VL model"
        )
    assets = model_assets(text, vision, Path(mmproj_path) if mmproj_path is not None else None)
    model = build_model(lambda config: Qwen2VLModel(config, assets, vision), model_config(text, vision), shard)
    decoder_map = llama.gguf_tensor_map(text.num_hidden_layers, True, text.tie_word_embeddings, output_bias=False)
    assign_decoder(model, text_file, decoder_map, dtype, device, shard)
    if model.vision_module() is not None:
        assign_weights(model.visual, vision_file, qwen2vl_vision.gguf_tensor_map(model.visual), dtype, device)
    model.finish_loading(device, dtype)
    logger.info("loaded %s", model.config)
    return model
