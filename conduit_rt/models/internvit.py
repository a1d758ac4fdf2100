"""InternViT (InternVL3's vision tower), pixel shuffle and InternVL's MLP projector.

Per tile: patch embedding (a strided conv with bias) + CLS + learned position embeddings ->
pre-LayerNorm blocks whose attention and MLP outputs are scaled per channel (``layer_scale1`` /
``layer_scale2``, transformers' ``lambda_1`` / ``lambda_2``) before each residual add; no final norm
(transformers' ``use_mean_pooling``). ``InternVLProjector`` drops CLS, pixel-shuffles the patch grid
by ``1 / scale_factor`` (each scale_factor x scale_factor block of patches becomes one token with
the block's features concatenated, in transformers' order) and applies LayerNorm -> linear ->
activation -> linear. Attention and MLP are CLIP's modules (``clip``). ``gguf_tensor_map`` says which
GGUF tensor fills each parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from conduit_rt.errors import RequestError
from conduit_rt.gguf_names import MODEL_TENSOR, tensor_name
from conduit_rt.model_config import InternVLVisionConfig

from . import clip

PROJECTOR_LAYER_NORM_EPS = 1e-5  # transformers builds the projector's LayerNorm with nn.LayerNorm's default

_BLOCK_TENSORS = {
    "layer_norm1.weight": (MODEL_TENSOR.V_ENC_INPUT_NORM, "weight"),
    "layer_norm1.bias": (MODEL_TENSOR.V_ENC_INPUT_NORM, "bias"),
    "layer_norm2.weight": (MODEL_TENSOR.V_ENC_POST_ATTN_NORM, "weight"),
    "layer_norm2.bias": (MODEL_TENSOR.V_ENC_POST_ATTN_NORM, "bias"),
    "layer_scale1": (MODEL_TENSOR.V_LAYER_SCALE_1, "weight"),
    "layer_scale2": (MODEL_TENSOR.V_LAYER_SCALE_2, "weight"),
    **{f"{module}.{suffix}": (kind, suffix) for module, kind in (
        ("self_attn.q_proj", MODEL_TENSOR.V_ENC_ATTN_Q), ("self_attn.k_proj", MODEL_TENSOR.V_ENC_ATTN_K),
        ("self_attn.v_proj", MODEL_TENSOR.V_ENC_ATTN_V), ("self_attn.out_proj", MODEL_TENSOR.V_ENC_ATTN_O),
        ("mlp.fc1", MODEL_TENSOR.V_ENC_FFN_UP), ("mlp.fc2", MODEL_TENSOR.V_ENC_FFN_DOWN),
    ) for suffix in ("weight", "bias")},
}


def gguf_tensor_map(n_layers: int) -> dict[str, str]:
    """Parameter name of ``InternVisionTower`` -> GGUF tensor name."""
    mapping = {
        "patch_embedding.weight": tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH),
        "patch_embedding.bias": tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH, "bias"),
        "class_embedding": tensor_name(MODEL_TENSOR.V_ENC_EMBD_CLS, suffix=None),
        "position_embedding": tensor_name(MODEL_TENSOR.V_ENC_EMBD_POS),
    }
    for layer in range(n_layers):
        for param, (kind, suffix) in _BLOCK_TENSORS.items():
            mapping[f"layers.{layer}.{param}"] = tensor_name(kind, suffix, layer)
    return mapping


def projector_tensor_map() -> dict[str, str]:
    """Parameter name of ``InternVLProjector`` -> GGUF tensor name (llama.cpp's ``mm.0`` / ``mm.1`` / ``mm.3``)."""
    return {
        f"{module}.{suffix}": tensor_name(MODEL_TENSOR.V_MMPROJ, suffix, index)
        for module, index in (("layer_norm", 0), ("linear_1", 1), ("linear_2", 3))
        for suffix in ("weight", "bias")
    }


class InternVisionLayer(nn.Module):
    def __init__(self, config: InternVLVisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.self_attn = clip.ClipAttention(hidden, config.num_attention_heads)
        self.layer_scale1 = nn.Parameter(torch.empty(hidden))
        self.layer_norm2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.mlp = clip.ClipMLP(hidden, config.intermediate_size, config.hidden_act)
        self.layer_scale2 = nn.Parameter(torch.empty(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_scale1 * self.self_attn(self.layer_norm1(x)) + x
        return self.layer_scale2 * self.mlp(self.layer_norm2(x)) + x


class InternVisionTower(nn.Module):
    """pixel_values [n_tiles, C, image_size, image_size] -> hidden states [n_tiles, 1 + n_patches, hidden] (CLS first)."""

    def __init__(self, config: InternVLVisionConfig) -> None:
        super().__init__()
        self.config = config
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, kernel_size=patch, stride=patch)
        self.class_embedding = nn.Parameter(torch.empty(1, 1, hidden))
        self.position_embedding = nn.Parameter(torch.empty(1, config.num_positions, hidden))
        self.layers = nn.ModuleList(InternVisionLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        side, channels = self.config.image_size, self.config.num_channels
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (channels, side, side):
            raise RequestError(f"pixel_values must be [n, {channels}, {side}, {side}], got {list(pixel_values.shape)}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [n, n_patches, hidden], row-major
        cls = self.class_embedding.expand(patches.shape[0], -1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return x


def pixel_shuffle(features: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """[n, side, side, E] -> [n, side / s, side / s, E s^2], as transformers' ``InternVLModel.pixel_shuffle``
    with ratio 1 / s: the grid's columns are folded first, then its rows (with the axes swapped twice)."""
    n, width, height, channels = features.shape
    features = features.reshape(n, width, height // scale_factor, channels * scale_factor)
    features = features.permute(0, 2, 1, 3).reshape(
        n, height // scale_factor, width // scale_factor, channels * scale_factor**2
    )
    return features.permute(0, 2, 1, 3).contiguous()


class InternVLProjector(nn.Module):
    """Tower output [n_tiles, 1 + n_patches, E] -> [n_tiles, n_patches / s^2, text hidden]."""

    def __init__(self, config: InternVLVisionConfig) -> None:
        super().__init__()
        shuffled = config.hidden_size * config.scale_factor**2
        self.scale_factor = config.scale_factor
        self.layer_norm = nn.LayerNorm(shuffled, eps=PROJECTOR_LAYER_NORM_EPS)
        self.linear_1 = nn.Linear(shuffled, config.projection_dim)
        self.act = clip.activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(config.projection_dim, config.projection_dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        patches = hidden_states[:, 1:]
        n, count, channels = patches.shape
        side = int(round(count**0.5))
        shuffled = pixel_shuffle(patches.reshape(n, side, side, channels), self.scale_factor)
        shuffled = shuffled.reshape(n, -1, shuffled.shape[-1])
        return self.linear_2(self.act(self.linear_1(self.layer_norm(shuffled))))
