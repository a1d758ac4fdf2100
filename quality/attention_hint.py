"""An auxiliary training loss that points one attention head at the asked field.

Even when image tokens know their page's tag and the query token knows the asked tag and colour
(``context_probe.py``), retrieval sits on a saddle: the attention of the query is spread over a
hundred or more tokens, so neither the key/query match nor the value-to-answer copy gets a useful
gradient until the other exists. This loss breaks the symmetry: head 0 of the decoder layer just
above the probed one is trained, at each token that predicts an answer character, to put its attention on
the cell of the character it predicts (cross-entropy over the causal attention
distribution, computed exactly as the layer computes it: input RMSNorm, q/k projections, RoPE,
1/sqrt(d) scale). Training-time only; the shipped model is a plain ``LlavaForConditionalGeneration``.
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_hint_loss(model, hidden_states: tuple[torch.Tensor, ...], batch: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """Cross-entropy of head 0's attention (decoder layer ``layer + 1``, counted from 1, whose input
    is ``hidden_states[layer]`` [B, T, D]) at ``batch["hint_rows"/"hint_positions"]`` against the
    key positions ``batch["hint_targets"]`` [num_answer_chars] (int64)."""
    language_model = model.model.language_model
    block = language_model.layers[layer]
    head_dim = language_model.config.head_dim
    rows, positions, targets = batch["hint_rows"], batch["hint_positions"], batch["hint_targets"]
    normed = block.input_layernorm(hidden_states[layer])  # [B, T, D]
    keys = block.self_attn.k_proj(normed)[..., :head_dim]  # KV head 0: [B, T, d]
    queries = block.self_attn.q_proj(normed[rows, positions])[..., :head_dim]  # head 0: [Q, d]
    all_positions = torch.arange(normed.shape[1], device=normed.device)[None]
    cos, sin = language_model.rotary_emb(keys, position_ids=all_positions)  # [1, T, d]
    keys = keys * cos + _rotate_half(keys) * sin
    queries = queries * cos[0, positions] + _rotate_half(queries) * sin[0, positions]
    scores = torch.einsum("qd,qtd->qt", queries.float(), keys[rows].float()) / head_dim**0.5  # [Q, T]
    future = all_positions > positions[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    return nn.functional.cross_entropy(scores, targets)
