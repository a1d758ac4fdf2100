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

Both task models take them (LLaVA's Llama RoPE, Qwen2-VL's M-RoPE with the batch's 3-D positions).
Training-time only; the shipped models are plain ``LlavaForConditionalGeneration`` /
``Qwen2VLForConditionalGeneration``.
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_log_probs(model, hidden_states: tuple[torch.Tensor, ...], layer: int, head: int,
                        rows: torch.Tensor, positions: torch.Tensor,
                        position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax of query head ``head``'s causal attention in decoder layer ``layer + 1`` (counted
    from 1; its input is ``hidden_states[layer]`` [B, T, D]) at the queries (``rows``, ``positions``)
    [Q] int64: float32 [Q, T] (-inf at future keys).

    ``position_ids``: the RoPE positions of the batch, None for 0..T-1 on every row (LLaVA's Llama),
    int64 [3, B, T] for Qwen2-VL's M-RoPE (``qwen_model.mrope_position_ids``); the decoder's own
    rotary embedding turns them into cos/sin (M-RoPE: each frequency band from its t, h or w row)."""
    language_model = model.model.language_model
    block = language_model.layers[layer]
    config = language_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_head = head // (config.num_attention_heads // config.num_key_value_heads)
    normed = block.input_layernorm(hidden_states[layer])  # [B, T, D]
    keys = block.self_attn.k_proj(normed)[..., kv_head * head_dim:(kv_head + 1) * head_dim]  # [B, T, d]
    queries = block.self_attn.q_proj(normed[rows, positions])[..., head * head_dim:(head + 1) * head_dim]  # [Q, d]
    key_index = torch.arange(normed.shape[1], device=normed.device)[None]  # [1, T]
    cos, sin = language_model.rotary_emb(keys, position_ids=key_index if position_ids is None else position_ids)
    cos, sin = cos.expand(keys.shape[0], -1, -1), sin.expand(keys.shape[0], -1, -1)  # [B, T, d]
    keys = keys * cos + _rotate_half(keys) * sin
    queries = queries * cos[rows, positions] + _rotate_half(queries) * sin[rows, positions]
    scores = torch.einsum("qd,qtd->qt", queries.float(), keys[rows].float()) / head_dim**0.5  # [Q, T]
    scores = scores.masked_fill(key_index > positions[:, None], float("-inf"))
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
    [num_answer_chars] (int64); ``batch["position_ids"]`` [3, B, T] when the model uses M-RoPE."""
    log_probs = attention_log_probs(model, hidden_states, layer, 0, batch["hint_rows"], batch["hint_positions"],
                                    batch.get("position_ids"))
    return nn.functional.nll_loss(log_probs, batch["hint_targets"])


def field_hint_loss(model, hidden_states: tuple[torch.Tensor, ...], batch: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """The ``field`` hint: cross-entropy of ``field_hint_head``'s attention at the question rows
    ``batch["field_rows"/"field_positions"]`` [Q] against a uniform target over the cells listed for
    each of them in ``batch["field_queries"]``/``batch["field_targets"]`` [num_pairs] (query index,
    key position), all int64 (and ``batch["position_ids"]`` as above). Its minimum is the target's
    entropy (all mass on the listed cells)."""
    head = field_hint_head(model)
    log_probs = attention_log_probs(model, hidden_states, layer, head, batch["field_rows"], batch["field_positions"],
                                    batch.get("position_ids"))
    queries, targets = batch["field_queries"], batch["field_targets"]
    cells_per_query = torch.bincount(queries, minlength=log_probs.shape[0]).clamp(min=1).float()
    picked = log_probs[queries, targets] / cells_per_query[queries]  # each query's targets average to 1 weight
    return -picked.sum() / log_probs.shape[0]
