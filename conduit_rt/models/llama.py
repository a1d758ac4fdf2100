"""The Llama decoder, with its attention over the native KV arena.

One layer: RMSNorm -> q/k/v projections -> K (pre-RoPE) and V written into the sequence's slots,
the kernel rotating K at ``rope_positions`` -> q rotated with the same frequencies (``fused``) ->
causal-by-position attention over every stored token of the layer (the native kernel) -> o_proj ->
residual -> RMSNorm -> SwiGLU MLP -> residual. Module and parameter names follow transformers'
``LlamaModel`` so that the code reads like the reference; ``gguf_tensor_map`` says which GGUF tensor
fills each parameter. A layer runs as three parts, ``pre_attention`` (norm, projections, q rotation),
``LlamaAttention.attend`` (the native KV write and attention) and ``post_attention`` (output
projection, norm, MLP), so that ``prefill_graph`` can replay the dense parts from CUDA graphs.

After loading, ``stack_projections`` lays q/k/v and gate/up out as row blocks of one tensor each (the
parameters become views of it): a decode step reads each stack with one GEMV instead of three and
two, which streams closer to the bandwidth limit, and rotates q or applies the SiLU gate in the
same kernel (``fused.linear_rotate_q``, ``fused.linear_silu_gate``). Prefill runs gate/up as one
product too (the SiLU kernel reads both halves of its rows) but keeps one product per q/k/v
projection, whose outputs must be contiguous for the KV write and RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from conduit_rt.gguf_names import MODEL_TENSOR, tensor_name

from . import fused
from .base import ForwardBatch, LayerCapture, ModelConfig
from .rope import RotaryEmbedding

# parameter (relative to one layer) -> GGUF tensor kind, per llama.cpp's names
_LAYER_TENSORS = {
    "input_layernorm.weight": (MODEL_TENSOR.ATTN_NORM, "weight"),
    "self_attn.q_proj.weight": (MODEL_TENSOR.ATTN_Q, "weight"),
    "self_attn.k_proj.weight": (MODEL_TENSOR.ATTN_K, "weight"),
    "self_attn.v_proj.weight": (MODEL_TENSOR.ATTN_V, "weight"),
    "self_attn.o_proj.weight": (MODEL_TENSOR.ATTN_OUT, "weight"),
    "post_attention_layernorm.weight": (MODEL_TENSOR.FFN_NORM, "weight"),
    "mlp.gate_proj.weight": (MODEL_TENSOR.FFN_GATE, "weight"),
    "mlp.up_proj.weight": (MODEL_TENSOR.FFN_UP, "weight"),
    "mlp.down_proj.weight": (MODEL_TENSOR.FFN_DOWN, "weight"),
}
_BIAS_TENSORS = {
    "self_attn.q_proj.bias": (MODEL_TENSOR.ATTN_Q, "bias"),
    "self_attn.k_proj.bias": (MODEL_TENSOR.ATTN_K, "bias"),
    "self_attn.v_proj.bias": (MODEL_TENSOR.ATTN_V, "bias"),
    "self_attn.o_proj.bias": (MODEL_TENSOR.ATTN_OUT, "bias"),
}


def stack_rows(linears: list[nn.Linear], name: str) -> torch.Tensor:
    """Concatenates the ``name`` ("weight" or "bias") of ``linears`` along rows and makes each
    module's parameter a view of its block; returns the stack [sum of rows, ...]. Memory stays the
    same once the old tensors are released."""
    stacked = torch.cat([getattr(linear, name).detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = getattr(linear, name).shape[0]
        setattr(linear, name, nn.Parameter(stacked[start: start + rows], requires_grad=False))
        start += rows
    return stacked


class StackedProjections(nn.Module):
    """A module whose projections ``stack_projections`` lays out as one tensor each, the parameters
    becoming views of it. Anything that replaces a parameter afterwards (``module.to``, ``.double()``,
    ``load_state_dict(assign=True)``, assigning ``.weight`` or ``.data``) leaves the stack stale:
    conversions and loads rebuild it, and ``stack_current`` (checked before each use) sees the rest,
    whose callers then take the separate projections."""

    def __init__(self) -> None:
        super().__init__()
        self._views: list[tuple[nn.Linear, str, int]] = []  # (module, parameter, data_ptr it must keep)
        self.register_load_state_dict_post_hook(lambda module, _incompatible: module._restack())

    def stack_projections(self) -> None:
        raise NotImplementedError

    def _stack(self, linears: list[nn.Linear], name: str) -> torch.Tensor:
        stacked = stack_rows(linears, name)
        self._views += [(linear, name, getattr(linear, name).data_ptr()) for linear in linears]
        return stacked

    def stack_current(self) -> bool:
        """Whether the parameters are still the views of the stack made by ``stack_projections``."""
        return bool(self._views) and all(getattr(m, name).data_ptr() == ptr for m, name, ptr in self._views)

    def _restack(self) -> None:
        if self._views and not self.stack_current():
            self._views = []
            self.stack_projections()

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._restack()
        return result


def gguf_tensor_map(
    n_layers: int, attention_bias: bool, tie_word_embeddings: bool, output_bias: bool | None = None
) -> dict[str, str]:
    """Parameter name of ``LlamaDecoder`` -> GGUF tensor name. Tied embeddings: ``lm_head.weight``
    maps to ``token_embd.weight`` (one tensor, two parameters). ``output_bias`` (default: same as
    ``attention_bias``) False leaves o_proj without a bias, as in Qwen2."""
    embed = tensor_name(MODEL_TENSOR.TOKEN_EMBD)
    mapping = {
        "embed_tokens.weight": embed,
        "norm.weight": tensor_name(MODEL_TENSOR.OUTPUT_NORM),
        "lm_head.weight": embed if tie_word_embeddings else tensor_name(MODEL_TENSOR.OUTPUT),
    }
    per_layer = _LAYER_TENSORS | (_BIAS_TENSORS if attention_bias else {})
    if attention_bias and output_bias is False:
        per_layer = {param: kind for param, kind in per_layer.items() if param != "self_attn.o_proj.bias"}
    for layer in range(n_layers):
        for param, (kind, suffix) in per_layer.items():
            mapping[f"layers.{layer}.{param}"] = tensor_name(kind, suffix, layer)
    return mapping


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the reduction in float32 (as transformers' LlamaRMSNorm); one kernel on
    CUDA (``fused.rms_norm``)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


class LlamaAttention(StackedProjections):
    """``bias``: q/k/v (and, unless ``output_bias`` is False, o_proj) have biases."""

    def __init__(self, config: ModelConfig, bias: bool, output_bias: bool | None = None) -> None:
        super().__init__()
        q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden, q_rows, bias=bias)
        self.k_proj = nn.Linear(config.hidden, kv_rows, bias=bias)
        self.v_proj = nn.Linear(config.hidden, kv_rows, bias=bias)
        self.o_proj = nn.Linear(q_rows, config.hidden, bias=bias if output_bias is None else output_bias)
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.scale = config.attention_scale
        self.qkv_rows = (q_rows, kv_rows, kv_rows)
        # [q_rows + 2 kv_rows, hidden] (and [q_rows + 2 kv_rows]) after stack_projections; plain
        # attributes, not parameters: the state dict keeps transformers' names
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        # tensor parallel (``parallel.sharding``): this rank's heads only; ``output`` sums the ranks'
        self.parallel = None

    def stack_projections(self) -> None:
        projections = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_weight = self._stack(projections, "weight")
        self.qkv_bias = self._stack(projections, "bias") if self.q_proj.bias is not None else None

    def project(self, h: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [n, hidden] (normed) -> q [n, n_heads, head_dim] rotated with the RoPE ``tables`` (cos,
        sin [n, n_freq], ``RotaryEmbedding.tables``), and k, v [n, n_kv_heads, head_dim] before RoPE
        (the arena rotates K as it stores it), all contiguous."""
        n = h.shape[0]
        if n == 1 and self.stack_current():  # a decode step: one GEMV over the stack, q rotated in it
            q, kv = fused.linear_rotate_q(h, self.qkv_weight, self.qkv_bias, self.n_heads, self.head_dim, *tables)
            k, v = kv.split(self.qkv_rows[1:], dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
            q = fused.rotate(q.view(n, self.n_heads, self.head_dim), *tables).contiguous()
        return q, k.view(n, self.n_kv_heads, self.head_dim), v.view(n, self.n_kv_heads, self.head_dim)

    def attend(self, layer: int, seq, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               capture: LayerCapture | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Writes the n tokens' K (rotated at ``batch.rope_positions``) and V into the layer's slots,
        then attends q over every stored token of the layer, causal by position: [n, n_heads,
        head_dim] (into ``out`` when given). A capture sees q, k and v before, and the rows'
        log-sum-exp after (CONDUIT's scoring normalises by it instead of finding it again)."""
        if capture is None:
            return seq.write_kv_attention(layer, k, v, batch.slots, batch.rope_positions, q, batch.positions,
                                          self.scale, out=out)
        capture.on_layer(layer, q, k, v)
        out, lse = seq.write_kv_attention(layer, k, v, batch.slots, batch.rope_positions, q, batch.positions,
                                          self.scale, out=out, return_lse=True)
        capture.on_attention(layer, lse)
        return out

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """The output projection: attention [n, n_heads, head_dim] -> [n, hidden]. Tensor parallel:
        each rank projects its own heads (its columns of o_proj), and the all-reduce adds them up."""
        out = fused.linear(attn.view(attn.shape[0], self.n_heads * self.head_dim), self.o_proj.weight,
                           self.o_proj.bias)
        return out if self.parallel is None else self.parallel.all_reduce(out)


class LlamaMLP(StackedProjections):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [2 intermediate, hidden] after stack_projections
        self.parallel = None  # tensor parallel: this rank's rows of gate/up, columns of down; summed in forward

    def stack_projections(self) -> None:
        self.gate_up_weight = self._stack([self.gate_proj, self.up_proj], "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]; gate and up as one product over their stack."""
        if not self.stack_current():
            gated = fused.silu_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1))
        else:
            gated = fused.linear_silu_gate(x, self.gate_up_weight)
        out = fused.linear(gated, self.down_proj.weight)
        return out if self.parallel is None else self.parallel.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention_bias: bool, output_bias: bool | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attention_bias, output_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.rms_norm_eps)
        self.mlp = LlamaMLP(config.hidden, config.intermediate)

    # A layer is three parts so that a prefill pass can replay the dense ones from CUDA graphs
    # (prefill_graph.py) around the native attention, which runs eagerly.
    def pre_attention(self, x: torch.Tensor, delta: torch.Tensor | None, tables: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input is x + delta (delta None: x), [n, hidden]; returns it (the residual) and
        the attention's q, k, v (``LlamaAttention.project``)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = fused.add_rms_norm(x, delta, self.input_layernorm.weight, self.input_layernorm.eps)
        return (x, *self.self_attn.project(h, tables))

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual x [n, hidden] and the attention [n, n_heads, head_dim] -> the layer's output as
        the two terms of its last residual add, which the next layer's norm adds in the same kernel."""
        post = self.post_attention_layernorm
        x, h = fused.add_rms_norm(x, self.self_attn.output(attn), post.weight, post.eps)
        return x, self.mlp(h)

    def forward(
        self,
        layer: int,
        seq,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        batch: ForwardBatch,
        tables: tuple[torch.Tensor, torch.Tensor],
        capture: LayerCapture | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + delta [n, hidden] -> the layer's output (x, delta); writes the layer's K, V of the n
        tokens. ``tables``: the pass's RoPE cos and sin."""
        x, q, k, v = self.pre_attention(x, delta, tables)
        attn = self.self_attn.attend(layer, seq, q, k, v, batch, capture)
        return self.post_attention(x, attn)


class LlamaDecoder(nn.Module):
    """Token embeddings, the decoder layers, the final norm and the LM head.

    Built on the meta device and filled with ``load_state_dict(..., assign=True)``; call
    ``init_rotary(device)`` once the weights are in place. With ``config.rope.sections`` (M-RoPE)
    and ``attention_bias=True, output_bias=False`` this is Qwen2-VL's decoder.
    """

    def __init__(self, config: ModelConfig, attention_bias: bool = False, output_bias: bool | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_bias, output_bias) for _ in range(config.n_layers)
        )
        self.norm = RMSNorm(config.hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.parallel = None  # tensor parallel: lm_head holds this rank's rows of the vocabulary

    def init_rotary(self, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.config.rope, device)

    def stack_projections(self) -> None:
        """Once the weights are in place: q/k/v and gate/up of every layer as one tensor each."""
        for layer in self.layers:
            layer.self_attn.stack_projections()
            layer.mlp.stack_projections()

    def forward(
        self, seq, embeds: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """embeds [n, hidden] -> hidden states [n, hidden] before the final norm."""
        if self.rotary is None:
            raise RuntimeError("LlamaDecoder.init_rotary was not called after loading the weights")
        tables = self.rotary.tables(batch.rope_positions, embeds.dtype)  # once for every layer
        x, delta = embeds, None
        for index, layer in enumerate(self.layers):
            x, delta = layer(index, seq, x, delta, batch, tables, capture)
        return x if delta is None else x + delta

    def forward_layer(
        self, index: int, seq, x: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """Decoder layer ``index`` alone (layer-wise recompute): x [n, hidden] -> [n, hidden]."""
        if self.rotary is None:
            raise RuntimeError("LlamaDecoder.init_rotary was not called after loading the weights")
        tables = self.rotary.tables(batch.rope_positions, x.dtype)
        x, delta = self.layers[index](index, seq, x, None, batch, tables, capture)
        return x + delta

    def kv_projection(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K before RoPE and V that decoder layer ``index`` computes from its input x [n, hidden]
        (the previous layer's output), nothing written: [n, n_kv_heads, head_dim] each."""
        layer = self.layers[index]
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        shape = (x.shape[0], attn.n_kv_heads, attn.head_dim)
        return attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab] (LM head in the model dtype, as transformers).
        Tensor parallel: each rank's rows of the (padded) vocabulary, gathered in rank order."""
        logits = fused.linear(self.norm(hidden), self.lm_head.weight)
        if self.parallel is not None:
            logits = self.parallel.gather(logits, dim=-1)[:, : self.config.vocab]
        return logits.float()
