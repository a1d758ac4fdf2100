"""Megatron-style split of a loaded decoder over the ranks of a ``TensorParallelGroup``.

Rank r of N keeps, per layer: the q rows of attention heads [r H/N, (r+1) H/N), the k and v rows
of KV heads [r KVH/N, (r+1) KVH/N) (each rank's query heads read its own KV heads: the grouping is
kept), the matching columns of o_proj, and the rows [r I/N, (r+1) I/N) of the MLP's gate and up
projections with those columns of down. o_proj and down each give a partial sum of the layer's
output, which one all-reduce adds up (``LlamaAttention.output``, ``LlamaMLP.forward``). Norms,
embeddings and the vision tower stay whole. The LM head is vocabulary-parallel: rank r computes
rows [r V'/N, (r+1) V'/N) of the vocabulary padded to V' (a multiple of N) and one all-gather
joins them (``LlamaDecoder.logits``).

Afterwards ``model.config`` describes the rank's share (its heads, KV heads and MLP width), which
is what the arena, the decode steps and the CUDA graphs are sized by; ``model.parallel`` is the
group, which the scores and statistics that sum over heads read to add up the other ranks' heads.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import TensorParallelError
from ..models.base import ModelConfig
from ..models.llama import LlamaDecoder
from .group import TensorParallelGroup


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raises TensorParallelError unless ``size`` ranks split the decoder evenly."""
    for what, count in (("attention heads", config.n_heads), ("KV heads", config.n_kv_heads),
                        ("MLP intermediate size", config.intermediate)):
        if count % size:
            raise TensorParallelError(f"tensor_parallel={size} does not divide the model's {count} {what}; "
                                      f"use a divisor of {count}")


def shard_model(model, group: TensorParallelGroup) -> None:
    """Keeps the rank's share of ``model``'s decoder (loaded whole on the rank's device) and frees
    the rest; sets ``model.config`` to the share and ``model.parallel`` to ``group``."""
    decoder = model.language_model
    if not isinstance(decoder, LlamaDecoder):
        raise TensorParallelError(f"tensor parallelism splits Llama-style decoders; this model's is "
                                  f"{type(decoder).__name__}")
    config = model.config
    check_shardable(config, group.size)
    rank, size, d = group.rank, group.size, config.head_dim
    heads, kv_heads, width = config.n_heads // size, config.n_kv_heads // size, config.intermediate // size
    q_rows = _block(rank, heads * d)
    kv_rows = _block(rank, kv_heads * d)
    mlp_rows = _block(rank, width)
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.q_proj, q_rows)
        _keep_rows(attn.k_proj, kv_rows)
        _keep_rows(attn.v_proj, kv_rows)
        _keep_columns(attn.o_proj, q_rows, keep_bias=rank == 0)  # the bias is added once, after the sum
        attn.n_heads, attn.n_kv_heads = heads, kv_heads
        attn.qkv_rows = (heads * d, kv_heads * d, kv_heads * d)
        _keep_rows(mlp.gate_proj, mlp_rows)
        _keep_rows(mlp.up_proj, mlp_rows)
        _keep_columns(mlp.down_proj, mlp_rows, keep_bias=rank == 0)
        attn.parallel = mlp.parallel = group
        attn._views, mlp._views = [], []  # the old stacks hold the whole weights: stacked again below
    decoder.lm_head.weight = nn.Parameter(_vocab_rows(decoder.lm_head.weight, rank, size), requires_grad=False)
    decoder.parallel = group
    decoder.stack_projections()
    share = dataclasses.replace(config, n_heads=heads, n_kv_heads=kv_heads, intermediate=width)
    model.config = decoder.config = share
    model.parallel = group
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _block(rank: int, rows: int) -> slice:
    return slice(rank * rows, (rank + 1) * rows)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)


def _keep_columns(linear: nn.Linear, columns: slice, keep_bias: bool) -> None:
    linear.weight = nn.Parameter(linear.weight[:, columns].contiguous(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        linear.bias = None


def _vocab_rows(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the LM head [vocab, hidden], the vocabulary padded with zero rows to a
    multiple of ``size`` (the padded logits are cut off after the gather)."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // size)
    rows = weight[rank * per_rank: min((rank + 1) * per_rank, vocab)]
    pad = per_rank - rows.shape[0]
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, weight.shape[1])])
    return rows.clone()
