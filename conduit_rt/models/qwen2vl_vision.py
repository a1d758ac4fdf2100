"""The Qwen2-VL / Qwen2.5-VL vision tower and patch merger, for any number of images of any size.

Input: the flattened patches of one or more images (``QwenVLPreprocessParams.preprocess``,
concatenated) and each image's patch grid (t, h, w). Steps, as transformers' ``visual`` module:

1. patch embedding: a Conv3D over (2 frames x 14 x 14) patches, i.e. one matrix product;
2. 2-D RoPE: the first half of each head's rotary frequencies turn with the patch row, the second
   half with its column (positions in merge-block order, as the patches come);
3. pre-norm blocks with bidirectional attention inside each image (Qwen2.5-VL: inside each
   ``window_size``-pixel window, except the ``fullatt_block_indexes`` blocks; the tokens are
   permuted window by window, in units of one merge block, for the whole tower and put back after
   the merger);
4. merger: norm, each 2x2 merge block concatenated, MLP to the text width.

Qwen2-VL: LayerNorm and a (quick-)GELU MLP; Qwen2.5-VL: RMSNorm and a gated SiLU MLP. Attention is
torch SDPA (no KV cache), batched over segments of equal length. Parameter names follow
transformers' ``visual`` module where they can; ``gguf_tensor_map`` gives the GGUF tensor of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from conduit_rt.errors import RequestError
from conduit_rt.gguf_names import MODEL_TENSOR, PATCH_EMBD_FRAME_1, tensor_name
from conduit_rt.model_config import QwenVisionConfig

from .clip import activation
from .llama import RMSNorm

Grid = tuple[int, int, int]  # (t, h, w) patches of one image, before merging

_BLOCK_TENSORS = {
    "norm1": MODEL_TENSOR.V_ENC_INPUT_NORM,
    "attn.q": MODEL_TENSOR.V_ENC_ATTN_Q,
    "attn.k": MODEL_TENSOR.V_ENC_ATTN_K,
    "attn.v": MODEL_TENSOR.V_ENC_ATTN_V,
    "attn.proj": MODEL_TENSOR.V_ENC_ATTN_O,
    "norm2": MODEL_TENSOR.V_ENC_POST_ATTN_NORM,
    "mlp.fc1": MODEL_TENSOR.V_ENC_FFN_UP,  # Qwen2-VL
    "mlp.fc2": MODEL_TENSOR.V_ENC_FFN_DOWN,
    "mlp.gate_proj": MODEL_TENSOR.V_ENC_FFN_GATE,  # Qwen2.5-VL
    "mlp.up_proj": MODEL_TENSOR.V_ENC_FFN_UP,
    "mlp.down_proj": MODEL_TENSOR.V_ENC_FFN_DOWN,
}


def gguf_tensor_map(tower: nn.Module) -> dict[str, str]:
    """Parameter name of ``QwenVisionTower`` -> GGUF tensor name (``gguf_names.qwen_vision_mmproj_tensor_shapes``)."""
    fixed = {
        "patch_embed.frame_0": tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH),
        "patch_embed.frame_1": PATCH_EMBD_FRAME_1,
        "merger.mlp.0.weight": tensor_name(MODEL_TENSOR.V_MMPROJ, "weight", 0),
        "merger.mlp.0.bias": tensor_name(MODEL_TENSOR.V_MMPROJ, "bias", 0),
        "merger.mlp.2.weight": tensor_name(MODEL_TENSOR.V_MMPROJ, "weight", 2),
        "merger.mlp.2.bias": tensor_name(MODEL_TENSOR.V_MMPROJ, "bias", 2),
    }
    mapping = {}
    for param, _ in tower.named_parameters():
        if param in fixed:
            mapping[param] = fixed[param]
        elif param.startswith("merger.ln_q."):
            mapping[param] = tensor_name(MODEL_TENSOR.V_POST_NORM, param.rsplit(".", 1)[1])
        else:  # blocks.N.<module>.<suffix>
            _, layer, rest = param.split(".", 2)
            module, suffix = rest.rsplit(".", 1)
            mapping[param] = tensor_name(_BLOCK_TENSORS[module], suffix, int(layer))
    return mapping


@dataclass(frozen=True)
class AttentionPlan:
    """Where the tokens go and which attend to which, for one batch of images (CPU-built, then moved).

    unit_order: long [n_units] or None: the merge-block units in window order (None = as given).
    full_groups / window_groups: the attention segments (each image; each window) in the (permuted)
        token order, as ``segment_groups`` gives them.
    cos, sin: float32 [n, head_dim] 2-D RoPE of each token, in the same order.
    """

    unit_order: torch.Tensor | None
    full_groups: list[torch.Tensor]
    window_groups: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor


def patch_positions(grids: Sequence[Grid], merge_size: int) -> torch.Tensor:
    """(row, column) of every patch, long [n, 2], in merge-block order (each m x m block consecutive)."""
    rows = []
    for t, h, w in grids:
        row = torch.arange(h)[:, None].expand(h, w)
        col = torch.arange(w)[None, :].expand(h, w)
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        pair = torch.stack([grid.reshape(blocks).transpose(1, 2).flatten() for grid in (row, col)], dim=-1)
        rows.append(pair.repeat(t, 1))
    return torch.cat(rows)


def window_order(grids: Sequence[Grid], merge_size: int, window_units: int) -> tuple[torch.Tensor, list[int]]:
    """Merge-block units sorted window by window (frame, window row, window column, then row-major
    inside the window), as transformers' ``get_vision_window_index``; and each window's unit count."""
    orders, lengths, offset = [], [], 0
    for t, h, w in grids:
        unit_h, unit_w = h // merge_size, w // merge_size
        windows_h, windows_w = -(-unit_h // window_units), -(-unit_w // window_units)
        window_row = torch.arange(unit_h) // window_units
        window_col = torch.arange(unit_w) // window_units
        window_id = (torch.arange(t)[:, None, None] * windows_h + window_row[None, :, None]) * windows_w + window_col
        window_id = window_id.flatten()
        orders.append(torch.argsort(window_id, stable=True) + offset)
        lengths.extend(torch.bincount(window_id).tolist())
        offset += t * unit_h * unit_w
    return torch.cat(orders), lengths


def vision_rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [n, head_dim] of patch (row, column) positions long [n, 2]."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))  # [head_dim / 4]
    freqs = positions[..., None].float() * inv_freq  # [n, 2, head_dim / 4]
    angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def segment_groups(bounds: list[int], device: torch.device) -> list[torch.Tensor]:
    """Segments [bounds[i], bounds[i + 1]) grouped by length: one long index [segments, length] per
    length, on ``device`` (built once per batch of images, used by every block)."""
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    return [
        (starts[lengths == length][:, None] + torch.arange(length)).to(device) for length in lengths.unique().tolist()
    ]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor]) -> torch.Tensor:
    """q, k, v [n, heads, d] -> [n, heads, d]: each token attends to every token of its segment and
    no other; the segments of one group (``segment_groups``) go through one batched SDPA call."""
    out = torch.empty_like(q)
    for index in groups:  # [segments, length]
        gathered = [x[index].transpose(1, 2) for x in (q, k, v)]  # [segments, heads, length, d]
        out[index] = F.scaled_dot_product_attention(*gathered).transpose(1, 2)
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [n, heads, d] in float32 (as transformers' vision towers), back to x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor, plan: AttentionPlan, groups: list[torch.Tensor]) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]."""
        n, hidden = x.shape

        def heads(projected: torch.Tensor) -> torch.Tensor:
            return projected.view(n, self.n_heads, hidden // self.n_heads)

        q = rotate(heads(self.q(x)), plan.cos, plan.sin)
        k = rotate(heads(self.k(x)), plan.cos, plan.sin)
        return self.proj(segment_attention(q, k, heads(self.v(x)), groups).reshape(n, hidden))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1 x)). Qwen2.5-VL (``gated``): down_proj(act(gate_proj x) * up_proj x)."""

    def __init__(self, hidden: int, intermediate: int, act: str, gated: bool) -> None:
        super().__init__()
        self.act, self.gated = activation(act), gated
        if gated:
            self.gate_proj = nn.Linear(hidden, intermediate)
            self.up_proj = nn.Linear(hidden, intermediate)
            self.down_proj = nn.Linear(intermediate, hidden)
        else:
            self.fc1 = nn.Linear(hidden, intermediate)
            self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


def _norm(config: QwenVisionConfig) -> nn.Module:
    if config.is_qwen25:
        return RMSNorm(config.hidden_size, config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(config), _norm(config)
        self.attn = VisionAttention(config.hidden_size, config.num_attention_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, gated=config.is_qwen25)

    def forward(self, x: torch.Tensor, plan: AttentionPlan, groups: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), plan, groups)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The Conv3D (kernel = stride = 2 x p x p, no bias) as a matrix product over flattened patches."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        shape = (config.hidden_size, config.num_channels, config.patch_size, config.patch_size)
        self.frame_0 = nn.Parameter(torch.empty(shape))  # kernel[:, :, 0]
        self.frame_1 = nn.Parameter(torch.empty(shape))  # kernel[:, :, 1]

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [n, C * 2 * p * p] in (channel, frame, y, x) order -> [n, hidden]."""
        kernel = torch.stack((self.frame_0, self.frame_1), dim=2)  # [hidden, C, 2, p, p]
        return F.linear(patches.to(kernel.dtype), kernel.reshape(kernel.shape[0], -1))


class PatchMerger(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.ln_q = _norm(config)
        merged = config.hidden_size * config.spatial_merge_size**2
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.projection_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] (each merge block's m^2 tokens consecutive) -> [n / m^2, projection_dim]."""
        merged = self.mlp[0].in_features
        return self.mlp(self.ln_q(x).reshape(-1, merged))


class QwenVisionTower(nn.Module):
    """Flattened patches of several images -> their merged embeddings, concatenated in image order."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.merger = PatchMerger(config)

    def plan(self, grids: Sequence[Grid], device: torch.device) -> AttentionPlan:
        """The token order, segments and RoPE of a batch of images."""
        c = self.config
        unit = c.spatial_merge_size**2
        full_bounds = [0]
        for t, h, w in grids:
            for _ in range(t):  # each frame of each image is one full-attention segment
                full_bounds.append(full_bounds[-1] + h * w)
        cos, sin = vision_rope(patch_positions(grids, c.spatial_merge_size), c.head_dim, c.rope_theta)
        if not c.uses_windows:
            full = segment_groups(full_bounds, device)
            return AttentionPlan(None, full, full, cos.to(device), sin.to(device))
        order, lengths = window_order(grids, c.spatial_merge_size, c.window_size // c.merge_factor)
        window_bounds = torch.cumsum(torch.tensor([0, *lengths]), 0).mul(unit).tolist()
        token_order = (order[:, None] * unit + torch.arange(unit)).flatten()
        return AttentionPlan(
            order.to(device),
            segment_groups(full_bounds, device),
            segment_groups(window_bounds, device),
            cos[token_order].to(device),
            sin[token_order].to(device),
        )

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values [sum t*h*w, C * 2 * p * p]; grids (t, h, w) per image -> [sum t*h*w / m^2, projection_dim]."""
        c = self.config
        expected = (sum(t * h * w for t, h, w in grids), c.num_channels * 2 * c.patch_size**2)
        if tuple(pixel_values.shape) != expected:
            raise RequestError(
                f"pixel_values must be {list(expected)} for grids {list(grids)}, got {list(pixel_values.shape)}"
            )
        plan = self.plan(grids, pixel_values.device)
        x = self.patch_embed(pixel_values)
        unit = c.spatial_merge_size**2
        if plan.unit_order is not None:
            x = x.view(-1, unit, x.shape[-1])[plan.unit_order].view(x.shape)
        for index, block in enumerate(self.blocks):
            windowed = plan.unit_order is not None and index not in c.fullatt_block_indexes
            x = block(x, plan, plan.window_groups if windowed else plan.full_groups)
        merged = self.merger(x)
        if plan.unit_order is not None:
            merged = merged[torch.argsort(plan.unit_order)]
        return merged
