"""The CLIP vision tower (ViT) as LLaVA uses it: the hidden states of its feature layer.

Patch embedding (a strided conv, no bias) + CLS + learned position embeddings -> pre-LayerNorm ->
pre-norm transformer blocks (bidirectional attention, MLP with ``hidden_act``). An ``mmproj.gguf``
stores only the blocks that feed the projector, so the output of the last stored block is
transformers' ``hidden_states[vision_feature_layer]`` (no post-LayerNorm). Parameter names follow
transformers' ``CLIPVisionTransformer``; ``gguf_tensor_map`` says which GGUF tensor fills each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from conduit_rt.errors import RequestError, UnsupportedArchitectureError
from conduit_rt.gguf_names import MODEL_TENSOR, tensor_name
from conduit_rt.model_config import VisionModelConfig


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function transformers calls ``name`` (ACT2FN)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        ) from None


# parameter (relative to one block) -> GGUF tensor kind
_BLOCK_TENSORS = {
    "layer_norm1": MODEL_TENSOR.V_ENC_INPUT_NORM,
    "self_attn.q_proj": MODEL_TENSOR.V_ENC_ATTN_Q,
    "self_attn.k_proj": MODEL_TENSOR.V_ENC_ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.V_ENC_ATTN_V,
    "self_attn.out_proj": MODEL_TENSOR.V_ENC_ATTN_O,
    "layer_norm2": MODEL_TENSOR.V_ENC_POST_ATTN_NORM,
    "mlp.fc1": MODEL_TENSOR.V_ENC_FFN_UP,
    "mlp.fc2": MODEL_TENSOR.V_ENC_FFN_DOWN,
}


def gguf_tensor_map(n_layers: int) -> dict[str, str]:
    """Parameter name of ``ClipVisionTower`` -> GGUF tensor name."""
    mapping = {
        "patch_embedding.weight": tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH),
        "class_embedding": tensor_name(MODEL_TENSOR.V_ENC_EMBD_CLS, suffix=None),
        "position_embedding.weight": tensor_name(MODEL_TENSOR.V_ENC_EMBD_POS),
        "pre_layrnorm.weight": tensor_name(MODEL_TENSOR.V_PRE_NORM, "weight"),
        "pre_layrnorm.bias": tensor_name(MODEL_TENSOR.V_PRE_NORM, "bias"),
    }
    for layer in range(n_layers):
        for param, kind in _BLOCK_TENSORS.items():
            for suffix in ("weight", "bias"):
                mapping[f"layers.{layer}.{param}.{suffix}"] = tensor_name(kind, suffix, layer)
    return mapping


class ClipAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, t, hidden] -> [b, t, hidden]; every position sees every other (no mask)."""
        b, t, hidden = x.shape

        def heads(projected: torch.Tensor) -> torch.Tensor:  # [b, t, hidden] -> [b, heads, t, head_dim]
            return projected.view(b, t, self.n_heads, hidden // self.n_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, t, hidden))


class ClipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: VisionModelConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipVisionTower(nn.Module):
    """pixel_values [b, C, image_size, image_size] -> hidden states [b, 1 + n_patches, hidden] (CLS first)."""

    def __init__(self, config: VisionModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, kernel_size=patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.position_embedding = nn.Embedding(config.num_positions, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(ClipEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[b, C, H, W] -> [b, 1 + n_patches, hidden]: CLS then patches in row-major order, plus positions."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [b, n_patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        side = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, side, side):
            raise RequestError(
                f"pixel_values must be [n, {self.config.num_channels}, {side}, {side}], got {list(pixel_values.shape)}"
            )
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.layers:
            x = layer(x)
        return x
