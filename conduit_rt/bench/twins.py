"""The transformers models the end-to-end prefill rows compare our decoder with, each running the
very tensors of our model (its parameters are our parameters, not copies, except where said), and
the one call shape they are timed through.

A twin's prefill takes ``DecoderInputs`` (what our decoder receives for a prompt: input embeddings,
RoPE positions, which tokens are visual) and returns a call that runs the whole prompt once and
gives the last token's logits (float32 [vocab]); the inputs are laid out for the twin before the
call, so the call times the decoder alone.

- ``causal_lm_prefill(model)``: a ``*ForCausalLM`` (LLaVA's ``LlamaForCausalLM``,
  ``qwen2_twin``'s ``Qwen2ForCausalLM``) on ``inputs_embeds``; its positions are the token indices,
  as ours (LLaVA, InternVL3).
- ``qwen2_twin(model)``: InternVL3's decoder as ``Qwen2ForCausalLM`` (q/k/v biases, 1-D RoPE).
- ``qwen3vl_twin(model)``: Qwen3-VL's decoder as transformers' ``Qwen3VLTextModel`` and our LM
  head, fed our M-RoPE positions [3, n] and the DeepStack features of the visual tokens (the
  columns after ``hidden`` of their input embeddings). ``Qwen3VLDecoder.permute_heads`` reordered
  each head's q/k rows and q/k norm weights for the sectioned rotation; the twin rotates the
  interleaved way and takes those four tensors of each layer in the original order (its own
  copies, ~1.5 GB in bf16 at the 8B shape); the others are shared.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conduit_rt.extras import require
from conduit_rt.models.rope import head_permutation

from .synthetic import TWIN


@dataclass(frozen=True, slots=True)
class DecoderInputs:
    """A prompt as our decoder takes it, on the model's device.

    embeds: [n, embedding_width], model dtype (Qwen3-VL: hidden, then the DeepStack features).
    rope: int64 [n] (1-D RoPE) or [3, n] (M-RoPE): the RoPE positions the runtime uses.
    visual: bool [n]: the image tokens.
    """

    embeds: torch.Tensor
    rope: torch.Tensor
    visual: torch.Tensor


Prefill = Callable[[DecoderInputs], Callable[[], torch.Tensor]]


def causal_lm_prefill(model) -> Prefill:
    """A ``*ForCausalLM``'s prefill of the input embeddings (KV cache kept, last-token logits only)."""

    def prefill(inputs: DecoderInputs) -> Callable[[], torch.Tensor]:
        embeds = inputs.embeds[None]
        return lambda: model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1).logits[0, -1].float()

    return prefill


def _decoder_parameters(model) -> dict[str, torch.Tensor]:
    """Our decoder's parameters under transformers' ``*ForCausalLM`` names."""
    return {name if name.startswith("lm_head") else f"model.{name}": p
            for name, p in model.language_model.named_parameters()}


def qwen2_twin(model):
    """``Qwen2ForCausalLM`` (SDPA) sharing ``model``'s decoder parameters (InternVL3's decoder)."""
    require("transformers", **TWIN)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    c = model.config
    if c.head_dim * c.n_heads != c.hidden:
        raise ValueError(f"Qwen2 takes head_dim = hidden / heads; this decoder has {c.head_dim}")
    config = Qwen2Config(
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope.theta}, max_position_embeddings=c.context_length,
        tie_word_embeddings=False, use_sliding_window=False, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, attn_implementation="sdpa",
    )
    with torch.device("meta"):
        twin = Qwen2ForCausalLM(config)
    twin.load_state_dict(_decoder_parameters(model), strict=True, assign=True)
    twin.model.rotary_emb = Qwen2RotaryEmbedding(config).to(model.device)  # built off meta: real inv_freq
    return twin.eval().requires_grad_(False)


class Qwen3VLTextTwin:
    """transformers' ``Qwen3VLTextModel`` and our LM head: a Qwen3-VL decoder's prefill."""

    def __init__(self, text_model, lm_head: torch.Tensor, hidden: int, deepstack_layers: int) -> None:
        self.text_model, self.lm_head = text_model, lm_head
        self.hidden, self.deepstack_layers = hidden, deepstack_layers

    def prefill(self, inputs: DecoderInputs) -> Callable[[], torch.Tensor]:
        """Embeddings [1, n, hidden], positions [3, 1, n], the visual mask [1, n] and one [n_visual,
        hidden] DeepStack feature per layer, as ``Qwen3VLModel`` hands them to its text model."""
        h = self.hidden
        embeds = inputs.embeds[None, :, :h]
        positions = inputs.rope.to(torch.long)[:, None, :]
        mask = inputs.visual[None]
        visual = inputs.embeds[inputs.visual]
        deepstack = [visual[:, h * (i + 1): h * (i + 2)] for i in range(self.deepstack_layers)]

        def run() -> torch.Tensor:
            out = self.text_model(inputs_embeds=embeds, position_ids=positions, visual_pos_masks=mask,
                                  deepstack_visual_embeds=deepstack or None, use_cache=True)
            return F.linear(out.last_hidden_state[0, -1], self.lm_head).float()

        return run


def _heads_in_original_order(model) -> dict[str, torch.Tensor]:
    """Copies of each layer's q/k projection rows and q/k norm weights, undoing ``permute_heads``."""
    c = model.config
    restore = torch.argsort(head_permutation(c.rope, c.head_dim)).to(model.device)
    out = {}
    for index, layer in enumerate(model.language_model.layers):
        attn, prefix = layer.self_attn, f"layers.{index}.self_attn"
        for name, proj, heads in (("q_proj", attn.q_proj, c.n_heads), ("k_proj", attn.k_proj, c.n_kv_heads)):
            weight = proj.weight
            out[f"{prefix}.{name}.weight"] = weight.view(heads, c.head_dim, -1)[:, restore].reshape(weight.shape)
        for name, norm in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm)):
            out[f"{prefix}.{name}.weight"] = norm.weight[restore].clone()
    return out


def qwen3vl_twin(model) -> Qwen3VLTextTwin:
    """transformers' ``Qwen3VLTextModel`` (SDPA) with ``model``'s decoder tensors (q/k in the
    original order: see the module docstring) and its LM head."""
    require("transformers", **TWIN)
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel, Qwen3VLTextRotaryEmbedding

    c = model.config
    config = Qwen3VLTextConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.context_length, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope.theta, "mrope_section": list(c.rope.sections),
                         "mrope_interleaved": True},
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        text_model = Qwen3VLTextModel(config)
    params = {name: p for name, p in model.language_model.named_parameters() if not name.startswith("lm_head")}
    params |= _heads_in_original_order(model)
    text_model.load_state_dict(params, strict=True, assign=True)
    text_model.rotary_emb = Qwen3VLTextRotaryEmbedding(config).to(model.device)  # built off meta: real inv_freq
    text_model.eval().requires_grad_(False)
    return Qwen3VLTextTwin(text_model, model.language_model.lm_head.weight, c.hidden, c.deepstack_layers)
