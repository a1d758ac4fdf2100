"""Qwen3-VL: vision tower with DeepStack mergers -> Qwen3 decoder with interleaved M-RoPE and DeepStack.

``load(text_path, mmproj_path, device, dtype)`` reads ``model.gguf`` (architecture "qwen3vl") and
``mmproj.gguf`` (projector "qwen3vl_merger"). Positions are Qwen2-VL's (``qwen2vl.mrope_positions``:
transformers' ``get_rope_index`` gives the same for images), and so are preparing and encoding images.

The decoder is ``llama.LlamaDecoder`` without biases, with an RMSNorm over each q and k head before
RoPE, and interleaved M-RoPE: the loader permutes each head's q/k rows (and the q/k norm weights)
into the frequency order of ``rope.head_permutation``, so that the sectioned rotation of q and of
the arena's K equals transformers' interleaved one (q.k is unchanged by a common permutation).

DeepStack: an image token's input embedding carries, after its ``hidden`` merged values, one
``hidden``-wide feature per DeepStack layer (``qwen3vl_vision``); text tokens carry zeros there.
The output of decoder layer i < ``deepstack_layers`` gets feature i added, as transformers adds it
at the visual positions (adding zeros leaves text tokens exact). The embedding cache keeps the
whole width, so a recompute of any visual token (CONDUIT's refresh) adds its features again. A
layer-wise recompute (``forward_layer``) hands the features along: its input and output are
embedding-wide, the decoder's state in the first ``hidden`` columns.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from conduit_rt.errors import ModelFormatError
from conduit_rt.gguf_names import MODEL_TENSOR, tensor_name
from conduit_rt.model_config import QwenVisionConfig, TextModelConfig

from . import fused, llama, qwen3vl_vision
from .arena_model import (
    ArenaVisionLanguageModel,
    assign_decoder,
    assign_weights,
    build_model,
    decoder_config,
    open_model_files,
)
from .base import ForwardBatch, LayerCapture, ModelAssets, ModelConfig
from .qwen2vl import Qwen2VLModel, model_assets
from .rope import RopeConfig, head_permutation

if TYPE_CHECKING:
    from conduit_rt.parallel.sharding import DecoderShard

logger = logging.getLogger(__name__)


class Qwen3Attention(llama.LlamaAttention):
    """Llama attention (no biases) with an RMSNorm over each q and k head before RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, bias=False)
        self.q_norm = llama.RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = llama.RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, h: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``LlamaAttention.project``, the q and k heads normed before q is rotated."""
        n, d = h.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(h).view(-1, d)).view(n, self.n_heads, d)
        k = self.k_norm(self.k_proj(h).view(-1, d)).view(n, self.n_kv_heads, d)
        q = fused.rotate(q, *tables).contiguous()
        return q, k, self.v_proj(h).view(n, self.n_kv_heads, d)


class Qwen3VLDecoder(llama.LlamaDecoder):
    """The Qwen3 decoder, with DeepStack features added to the first ``deepstack_layers`` outputs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for layer in self.layers:
            layer.self_attn = Qwen3Attention(config)

    def forward(
        self, seq, embeds: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """embeds [n, hidden] or [n, embedding_width] -> hidden states [n, hidden] before the final norm."""
        if self.rotary is None:
            raise RuntimeError("LlamaDecoder.init_rotary was not called after loading the weights")
        features = self._features(embeds)
        tables = self.rotary.tables(batch.rope_positions, embeds.dtype)
        x, delta = embeds[:, : self.config.hidden], None
        for index, layer in enumerate(self.layers):
            x, delta = layer(index, seq, x, delta, batch, tables, capture)
            if index < len(features):  # the next layer's norm adds the feature to the layer's output
                x, delta = x + delta, features[index]
        return x + delta

    def forward_layer(
        self, index: int, seq, x: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """Decoder layer ``index`` alone: x [n, hidden] or [n, embedding_width] (the state, then the
        DeepStack features) -> the same width, the layer's feature added to its output."""
        hidden = self.config.hidden
        out = super().forward_layer(index, seq, x[:, :hidden], batch, capture)
        features = self._features(x)
        if not features:
            return out
        if index < len(features):
            out = out + features[index]
        return torch.cat([out, x[:, hidden:]], dim=1)

    def kv_projection(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K before RoPE (q/k norm applied, as the arena stores it) and V of layer ``index`` from its
        input x [n, hidden or embedding_width], nothing written: [n, n_kv_heads, head_dim] each."""
        attn = self.layers[index].self_attn
        h = self.layers[index].input_layernorm(x[:, : self.config.hidden])
        shape = (x.shape[0], attn.n_kv_heads, attn.head_dim)
        k = attn.k_norm(attn.k_proj(h).view(-1, attn.head_dim)).view(shape)
        return k, attn.v_proj(h).view(shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().logits(hidden[:, : self.config.hidden])

    def _features(self, embeds: torch.Tensor) -> list[torch.Tensor]:
        """The DeepStack features of embeds [n, width]: one [n, hidden] view per layer (none for a
        text-only width)."""
        hidden = self.config.hidden
        return list(embeds[:, hidden:].split(hidden, dim=1)) if embeds.shape[1] > hidden else []

    def permute_heads(self) -> None:
        """Once the weights are in place: q/k rows and norm weights of every head in the frequency
        order of the sectioned rotation (``rope.head_permutation``)."""
        c = self.config
        order = head_permutation(c.rope, c.head_dim).to(self.embed_tokens.weight.device)
        for layer in self.layers:
            attn = layer.self_attn
            for proj, heads in ((attn.q_proj, c.n_heads), (attn.k_proj, c.n_kv_heads)):
                rows = proj.weight.view(heads, c.head_dim, -1)[:, order].reshape(proj.weight.shape)
                proj.weight = nn.Parameter(rows, requires_grad=False)
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight = nn.Parameter(norm.weight[order], requires_grad=False)


class Qwen3VLModel(Qwen2VLModel):
    """A loaded Qwen3-VL (see ``base.VisionLanguageModel`` for the contract of each method): Qwen2-VL's
    image preparation, encoding and positions over its own tower and decoder."""

    def __init__(self, config: ModelConfig, assets: ModelAssets, vision: QwenVisionConfig | None) -> None:
        ArenaVisionLanguageModel.__init__(self, config, assets, Qwen3VLDecoder(config))
        self.visual = qwen3vl_vision.QwenVision3Tower(vision) if vision else None
        self.merge_size = vision.spatial_merge_size if vision else 1

    @torch.no_grad()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [n] -> [n, embedding_width]: the token embeddings, zeros in the DeepStack columns."""
        embeds = self.language_model.embed_tokens(ids)
        extra = self.config.embedding_width - self.config.hidden
        return torch.cat([embeds, embeds.new_zeros(embeds.shape[0], extra)], dim=1) if extra else embeds

    def finish_loading(self, device: torch.device, dtype: torch.dtype) -> None:
        self.language_model.permute_heads()
        super().finish_loading(device, dtype)


def model_config(text: TextModelConfig, vision: QwenVisionConfig | None) -> ModelConfig:
    """The Runtime's view of a Qwen3-VL pair of files (tokens per image vary: 0 here)."""
    rope = RopeConfig(theta=text.rope_theta, rotary_dim=text.head_dim, sections=text.rope_sections, interleaved=True)
    config = decoder_config(text, "qwen3vl", rope, vision_hidden=vision.hidden_size if vision else 0)
    return dataclasses.replace(config, deepstack_layers=len(vision.deepstack_visual_indexes) if vision else 0)


def decoder_tensor_map(text: TextModelConfig) -> dict[str, str]:
    """Parameter name of ``Qwen3VLDecoder`` -> GGUF tensor name."""
    mapping = llama.gguf_tensor_map(text.num_hidden_layers, False, text.tie_word_embeddings)
    for layer in range(text.num_hidden_layers):
        for norm, kind in (("q_norm", MODEL_TENSOR.ATTN_Q_NORM), ("k_norm", MODEL_TENSOR.ATTN_K_NORM)):
            mapping[f"layers.{layer}.self_attn.{norm}.weight"] = tensor_name(kind, "weight", layer)
    return mapping


def load(
    text_path: str | Path, mmproj_path: str | Path | None, device: torch.device | str, dtype: torch.dtype | None = None,
    *, shard: DecoderShard | None = None,
) -> Qwen3VLModel:
    """Load ``model.gguf`` (+ ``mmproj.gguf``) onto ``device`` in ``dtype`` (default: float32 on CPU,
    bfloat16 on CUDA); with ``shard``, a tensor-parallel rank's share (``models.load_model``). Raises
    ``ModelFormatError`` naming the file and tensor at fault."""
    device, dtype, text_file, vision_file = open_model_files(text_path, mmproj_path, device, dtype)
    text, vision = text_file.config, vision_file.config if vision_file else None
    if vision is not None and not (isinstance(vision, QwenVisionConfig) and vision.is_qwen3):
        raise ModelFormatError(f"{mmproj_path}: projector {vision.projector_type!r} does not belong to a Qwen3-VL model")
    assets = model_assets(text, vision, Path(mmproj_path) if mmproj_path is not None else None)
    model = build_model(lambda config: Qwen3VLModel(config, assets, vision), model_config(text, vision), shard)
    assign_decoder(model, text_file, decoder_tensor_map(text), dtype, device, shard)
    if model.vision_module() is not None:
        assign_weights(model.visual, vision_file, qwen3vl_vision.gguf_tensor_map(model.visual), dtype, device)
    model.finish_loading(device, dtype)
    logger.info("loaded %s", model.config)
    return model
