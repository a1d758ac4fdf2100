"""Auxiliary training losses that point attention heads at the asked fields.

Even when image tokens know their page's tag and the query token knows the asked tag and colour
(``context_probe.py``), retrieval sits on a saddle: the attention of the query is spread over a
hundred or more tokens, so neither the key/query match nor the value-to-answer copy gets a useful
gradient until the other exists. Two hints on the decoder layer just above the probed one break the
symmetry, each a cross-entropy over a head's causal attention distribution, computed exactly as the
layer computes it (input RMSNorm, q/k projections, RoPE, 1/sqrt(d) scale):

- ``read``: head 0, at each token that predicts an answer character, attends to the cell of the
  character it predicts (a point target);
- ``field``: the first head of the second KV group, at the question's last three tokens (the colour,
  "?", " ASSISTANT:"), attends to all cells of the asked field(s) (a uniform target over 3 or 6 cells): the
  question looks at what it asks about, as question tokens of pretrained VLMs look at the region
  they ask about. This is what makes the question's attention identify the image tokens an answer
  needs, the premise of attention-based refresh (CONDUIT) and of VL-Cache; without it only the
  decode-time reads look at a field's second and third cells (docs/quality/findings.md: the oracle study).

Training-time only; the shipped model is a plain ``LlavaForConditionalGeneration``.
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_log_probs(model, hidden_states: tuple[torch.Tensor, ...], layer: int, head: int,
                        rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """log softmax of query head ``head``'s causal attention in decoder layer ``layer + 1`` (counted
    from 1; its input is ``hidden_states[layer]`` [B, T, D]) at the queries (``rows``, ``positions``)
    [Q] int64: float32 [Q, T] (-inf at future keys)."""
    language_model = model.model.language_model
    block = language_model.layers[layer]
    config = language_model.config
    head_dim = config.head_dim
    kv_head = head // (config.num_attention_heads // config.num_key_value_heads)
    normed = block.input_layernorm(hidden_states[layer])  # [B, T, D]
    keys = block.self_attn.k_proj(normed)[..., kv_head * head_dim:(kv_head + 1) * head_dim]  # [B, T, d]
    queries = block.self_attn.q_proj(normed[rows, positions])[..., head * head_dim:(head + 1) * head_dim]  # [Q, d]
    all_positions = torch.arange(normed.shape[1], device=normed.device)[None]
    cos, sin = language_model.rotary_emb(keys, position_ids=all_positions)  # [1, T, d]
    keys = keys * cos + _rotate_half(keys) * sin
    queries = queries * cos[0, positions] + _rotate_half(queries) * sin[0, positions]
    scores = torch.einsum("qd,qtd->qt", queries.float(), keys[rows].float()) / head_dim**0.5  # [Q, T]
    scores = scores.masked_fill(all_positions > positions[:, None], float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def field_hint_head(model) -> int:
    """The head of the ``field`` hint: the first query head of the second KV group (head 0 when
    there is one KV group)."""
    config = model.model.language_model.config
    group = config.num_attention_heads // config.num_key_value_heads
    return group if config.num_key_value_heads > 1 else 0


def attention_hint_loss(model, hidden_states: tuple[torch.Tensor, ...], batch: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """The ``read`` hint: cross-entropy of head 0's attention (decoder layer ``layer + 1``) at
    ``batch["hint_rows"/"hint_positions"]`` against the key positions ``batch["hint_targets"]``
    [num_answer_chars] (int64)."""
    log_probs = attention_log_probs(model, hidden_states, layer, 0, batch["hint_rows"], batch["hint_positions"])
    return nn.functional.nll_loss(log_probs, batch["hint_targets"])


def field_hint_loss(model, hidden_states: tuple[torch.Tensor, ...], batch: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """The ``field`` hint: cross-entropy of ``field_hint_head``'s attention at the question rows
    ``batch["field_rows"/"field_positions"]`` [Q] against a uniform target over the cells listed for
    each of them in ``batch["field_queries"]``/``batch["field_targets"]`` [num_pairs] (query index,
    key position), all int64. Its minimum is the target's entropy (all mass on the listed cells)."""
    head = field_hint_head(model)
    log_probs = attention_log_probs(model, hidden_states, layer, head, batch["field_rows"], batch["field_positions"])
    queries, targets = batch["field_queries"], batch["field_targets"]
    cells_per_query = torch.bincount(queries, minlength=log_probs.shape[0]).clamp(min=1).float()
    picked = log_probs[queries, targets] / cells_per_query[queries]  # each query's targets average to 1 weight
    return -picked.sum() / log_probs.shape[0]
