"""The Qwen3-VL vision tower, its merger and its DeepStack mergers, for any number of images of any size.

Input: the flattened patches of one or more images (``QwenVLPreprocessParams.preprocess``, 16-px
patches, concatenated) and each image's patch grid (t, h, w). Steps, as transformers' ``visual``:

1. patch embedding: the Conv3D (2 frames x p x p, with bias) as one matrix product;
2. learned positions: the square grid of ``num_position_embeddings`` embeddings resampled to the
   image's (h, w) grid by bilinear interpolation with aligned corners (4 taps per patch), added;
3. 2-D RoPE as Qwen2-VL's (``qwen2vl_vision.vision_rope``) and LayerNorm pre-norm blocks with a fused
   qkv projection and bidirectional attention inside each image (no windows);
4. after each block of ``deepstack_visual_indexes``, a DeepStack merger (LayerNorm over each 2x2
   merge block's concatenation, MLP to the text width) of that block's output;
5. the merger: LayerNorm, each merge block concatenated, MLP to the text width.

``QwenVision3Tower.forward`` returns the merged embedding of each token followed by its DeepStack
features, [n, projection_dim * (1 + len(deepstack_visual_indexes))]: what the decoder's input
embedding of an image token is (``qwen3vl.Qwen3VLDecoder``). Parameter names follow transformers'
``visual`` module; ``gguf_tensor_map`` gives the GGUF tensor of each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from conduit_rt.errors import RequestError
from conduit_rt.gguf_names import MODEL_TENSOR, PATCH_EMBD_FRAME_1, qwen3vl_vision_tensor_name, tensor_name
from conduit_rt.model_config import QwenVisionConfig

from .clip import activation
from .qwen2vl_vision import Grid, PatchEmbed, patch_positions, rotate, segment_attention, segment_groups, vision_rope


def gguf_tensor_map(tower: QwenVision3Tower) -> dict[str, str]:
    """Parameter name of ``QwenVision3Tower`` -> GGUF tensor name (``gguf_names.qwen3vl_mmproj_tensor_shapes``)."""
    fixed = {
        "patch_embed.frame_0": tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH),
        "patch_embed.frame_1": PATCH_EMBD_FRAME_1,
        "patch_embed.bias": tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH, "bias"),
    }
    indexes = tower.config.deepstack_visual_indexes
    return {param: fixed.get(param) or qwen3vl_vision_tensor_name(param, indexes)
            for param, _ in tower.named_parameters()}


def position_taps(grids: Sequence[Grid], merge_size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (aligned corners) resampling of a side x side grid to each image's (h, w) patch grid,
    patches in merge-block order: indices long [n, 4] into the flattened grid and weights float32 [n, 4]."""
    positions = patch_positions(grids, merge_size)
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])
    source = positions.float() * (side - 1) / (sizes - 1).clamp(min=1)  # [n, 2] (row, column) on the grid
    floor = source.floor()
    taps = (floor.long()[..., None] + torch.arange(2)).clamp(0, side - 1)  # [n, 2 axes, 2 taps]
    weights = (1 - (source[..., None] - floor[..., None] - torch.arange(2)).abs()).clamp(min=0)
    indices = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)
    return indices, (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)


class VisionAttention(nn.Module):
    """Bidirectional attention with a fused qkv projection (rows q | k | v) and 2-D RoPE."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], groups: list[torch.Tensor]) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]."""
        n, hidden = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, hidden // self.n_heads).unbind(1)
        q, k = rotate(q, *rope), rotate(k, *rope)
        return self.proj(segment_attention(q, k, v.contiguous(), groups).reshape(n, hidden))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config.hidden_size, config.num_attention_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], groups: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm (over each token, or over each merge block's concatenation: ``after_merge``), then
    the merge blocks through linear_fc1, GELU, linear_fc2."""

    def __init__(self, config: QwenVisionConfig, after_merge: bool) -> None:
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(merged if after_merge else config.hidden_size, eps=config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, config.projection_dim)
        self.merged, self.after_merge = merged, after_merge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] (each merge block's tokens consecutive) -> [n / m^2, projection_dim]."""
        x = self.norm(x.reshape(-1, self.merged)) if self.after_merge else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class BiasedPatchEmbed(PatchEmbed):
    """Qwen2-VL's patch embedding with the Conv3D's bias."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__(config)
        self.bias = nn.Parameter(torch.empty(config.hidden_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return super().forward(patches) + self.bias


class QwenVision3Tower(nn.Module):
    """Flattened patches of several images -> their merged embeddings and DeepStack features, in image order."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = BiasedPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.merger = PatchMerger(config, after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, after_merge=True) for _ in config.deepstack_visual_indexes
        )

    def positions(self, grids: Sequence[Grid]) -> torch.Tensor:
        """The learned position embedding of every patch [n, hidden], resampled to its image's grid."""
        side = round(self.config.num_position_embeddings**0.5)
        indices, weights = position_taps(grids, self.config.spatial_merge_size, side)
        weights = weights.to(self.pos_embed.weight.device)
        return (self.pos_embed(indices.to(weights.device)) * weights[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values [sum t*h*w, C * 2 * p * p]; grids (t, h, w) per image ->
        [sum t*h*w / m^2, projection_dim * (1 + deepstack)]: merged embedding, then each DeepStack feature."""
        c = self.config
        expected = (sum(t * h * w for t, h, w in grids), c.num_channels * 2 * c.patch_size**2)
        if tuple(pixel_values.shape) != expected:
            raise RequestError(
                f"pixel_values must be {list(expected)} for grids {list(grids)}, got {list(pixel_values.shape)}"
            )
        device = pixel_values.device
        bounds = [0]
        for t, h, w in grids:
            for _ in range(t):  # each frame of each image is one attention segment
                bounds.append(bounds[-1] + h * w)
        groups = segment_groups(bounds, device)
        cos, sin = vision_rope(patch_positions(grids, c.spatial_merge_size), c.head_dim, c.rope_theta)
        rope = (cos.to(device), sin.to(device))
        x = self.patch_embed(pixel_values)
        x = x + self.positions(grids).to(x.dtype)
        features = []
        for index, block in enumerate(self.blocks):
            x = block(x, rope, groups)
            if index in c.deepstack_visual_indexes:
                features.append(self.deepstack_merger_list[c.deepstack_visual_indexes.index(index)](x))
        return torch.cat([self.merger(x), *features], dim=-1)
