"""Megatron-style split of a Llama-style decoder over the ranks of a ``TensorParallelGroup``, made as
each rank loads its share.

Rank r of N keeps, per layer: the q rows of attention heads [r H/N, (r+1) H/N), the k and v rows
of KV heads [r KVH/N, (r+1) KVH/N) (each rank's query heads read its own KV heads: the grouping is
kept), the matching columns of o_proj, and the rows [r I/N, (r+1) I/N) of the MLP's gate and up
projections with those columns of down. q/k/v biases are split with their rows; o_proj's (and
down's) bias is kept by rank 0 only, since it is added once, after the sum. o_proj and down each
give a partial sum of the layer's output, which one all-reduce adds up (``LlamaAttention.output``,
``LlamaMLP.forward``). Norms (Qwen3's q/k head norms included) and the embeddings stay whole. The
LM head is vocabulary-parallel: rank r computes rows [r V'/N, (r+1) V'/N) of the vocabulary padded
to V' (a multiple of N) and one all-gather joins them (``LlamaDecoder.logits``).

``DecoderShard`` is one rank's plan, which the loader follows (``models.load_model(...,
shard=...)``): the model is built on the meta device from the rank's share of the config (its
heads, KV heads and MLP width, which is what the arena, the decode steps and the CUDA graphs are
sized by), and each split tensor is read from the mapped GGUF file as the rank's block alone
(``TensorPart``), so that no rank ever holds a whole split tensor. The vision tower and projector
are loaded by rank 0 only, which runs them (``group.encoded_on_first_rank``). Permutations the
loader applies within each head (llama.cpp's q/k row order, Qwen3-VL's frequency order) act on
whole heads, so a block of heads comes out as the same rows of the permuted whole.

``join_group`` then hands the loaded model its group: ``model.parallel``, which the scores and
statistics that sum over heads read to add up the other ranks' heads, and the layers' collectives.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import TensorParallelError
from ..models.base import ModelConfig
from ..models.llama import LlamaDecoder
from .group import TensorParallelGroup

# modules of a decoder layer whose rows (weight and bias) are split, and those whose columns are
_ROW_SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_COLUMN_SPLIT = ("self_attn.o_proj", "mlp.down_proj")
LM_HEAD = "lm_head.weight"


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raises TensorParallelError unless ``size`` ranks split the decoder evenly."""
    for what, count in (("attention heads", config.n_heads), ("KV heads", config.n_kv_heads),
                        ("MLP intermediate size", config.intermediate)):
        if count % size:
            raise TensorParallelError(f"tensor_parallel={size} does not divide the model's {count} {what}; "
                                      f"use a divisor of {count}")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorPart:
    """The block of a file tensor [rows, ...] or [rows] that one parameter takes: rows [start, stop)
    (None: all), of a 2-D tensor columns [start, stop) (None: all), then ``pad_rows`` zero rows."""

    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None
    pad_rows: int = 0

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        """The block's shape, of a tensor of shape ``whole``."""
        shape = list(whole)
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        if self.columns is not None:
            shape[1] = self.columns[1] - self.columns[0]
        shape[0] += self.pad_rows
        return tuple(shape)

    def read(self, model_file, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The block of tensor ``name`` of ``model_file`` (a ``GGUFModelFile``), on ``device`` in
        ``dtype``; only the block is read from the mapped file, and padded on the host."""
        if not self.pad_rows:
            return model_file.tensor(name, dtype, device, rows=self.rows, columns=self.columns)
        block = model_file.tensor(name, dtype, "cpu", rows=self.rows, columns=self.columns)
        return torch.cat([block, block.new_zeros(self.pad_rows, *block.shape[1:])]).to(device)


@dataclasses.dataclass(frozen=True, slots=True)
class DecoderShard:
    """Rank ``rank`` of ``size``: which share of the decoder it builds and reads, and whether it
    loads the vision tower (rank 0 only)."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not one of {self.size} ranks")

    @property
    def holds_vision(self) -> bool:
        """Whether this rank loads the vision tower and projector (rank 0 runs them for all)."""
        return self.rank == 0

    def share_config(self, config: ModelConfig) -> ModelConfig:
        """The rank's share of ``config``: its heads, KV heads and MLP width (TensorParallelError
        when ``size`` does not divide them)."""
        check_shardable(config, self.size)
        return dataclasses.replace(config, n_heads=config.n_heads // self.size,
                                   n_kv_heads=config.n_kv_heads // self.size,
                                   intermediate=config.intermediate // self.size)

    def vocab_rows(self, vocab: int) -> TensorPart:
        """The rank's rows of the LM head [vocab, hidden]: the vocabulary padded with zero rows to a
        multiple of ``size`` (the padded logits are cut off after the gather)."""
        per_rank = -(-vocab // self.size)
        start, stop = min(self.rank * per_rank, vocab), min((self.rank + 1) * per_rank, vocab)
        return TensorPart(rows=(start, stop), pad_rows=per_rank - (stop - start))

    def fit(self, model) -> None:
        """On ``model`` just built on the meta device from ``share_config``: the LM head takes the
        rank's vocabulary rows, o_proj and down keep a bias on rank 0 only, and a rank that does
        not hold the vision tower drops it (``release_vision``)."""
        decoder = model.language_model
        if not isinstance(decoder, LlamaDecoder):
            raise TensorParallelError(f"tensor parallelism splits Llama-style decoders; this model's is "
                                      f"{type(decoder).__name__}")
        config = decoder.config
        rows = self.vocab_rows(config.vocab).shape((config.vocab, config.hidden))[0]
        decoder.lm_head = nn.Linear(config.hidden, rows, bias=False, device="meta")
        if self.rank != 0:
            for layer in decoder.layers:
                layer.self_attn.o_proj.bias = None
                layer.mlp.down_proj.bias = None
        if not self.holds_vision:
            model.release_vision()

    def tensor_map(self, mapping: dict[str, str]) -> dict[str, str]:
        """A decoder's parameter -> GGUF tensor map without the output biases a rank other than 0
        does not keep."""
        if self.rank == 0:
            return mapping
        return {param: name for param, name in mapping.items()
                if not (param.endswith(".bias") and param.removesuffix(".bias").endswith(_COLUMN_SPLIT))}

    def parts(self, decoder: LlamaDecoder) -> dict[str, TensorPart]:
        """Parameter of ``decoder`` (built and fitted for this rank) -> the block of its file tensor
        it takes; the parameters not named (norms, embeddings) take their tensor whole."""
        parts = {LM_HEAD: self.vocab_rows(decoder.config.vocab)}
        for name, param in decoder.named_parameters():
            module = name.rpartition(".")[0]
            if module.endswith(_ROW_SPLIT):  # weight [rows, hidden] and bias [rows]
                parts[name] = TensorPart(rows=self._block(param.shape[0]))
            elif module.endswith(_COLUMN_SPLIT) and name.endswith(".weight"):
                parts[name] = TensorPart(columns=self._block(param.shape[1]))
        return parts

    def _block(self, per_rank: int) -> tuple[int, int]:
        return self.rank * per_rank, (self.rank + 1) * per_rank


def join_group(model, group: TensorParallelGroup) -> None:
    """Hands ``model``, loaded with this rank's ``DecoderShard``, its group: each layer's output
    all-reduces, the LM head's gather and ``model.parallel``."""
    decoder = model.language_model
    for layer in decoder.layers:
        layer.self_attn.parallel = layer.mlp.parallel = group
    decoder.parallel = group
    model.parallel = group
