"""The transformers models the families and end-to-end rows compare ours with, each running the
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
- ``qwen25vl_twin(model)``: Qwen2.5-VL's decoder as ``Qwen2_5_VLTextModel`` and our LM head, fed
  our M-RoPE positions [3, n]. Its sections are contiguous (t, h, w blocks of the frequencies, as
  ours): no row is permuted, every tensor is shared.

A vision twin takes ``VisionInputs`` (a batch of images as our tower takes them) and returns a
call giving the embeddings our decoder receives for them, [visual tokens, embedding width] in the
model's dtype, image after image; ``our_encode`` is our side of the comparison.

- ``qwen25vl_vision_twin(model)``: ``Qwen2_5_VisionTransformerPretrainedModel`` (window attention,
  merger); its fused qkv rows and Conv3D kernel are copies of our q/k/v rows and two frame
  kernels (~0.3 GB in bf16 at the 7B shape), the rest is shared.
- ``qwen3vl_vision_twin(model)``: ``Qwen3VLVisionModel``, its merged embeddings and DeepStack
  features concatenated as ours are; the Conv3D kernel is a copy.
- ``internvl_vision_twin(model)``: ``InternVLModel.get_image_features`` (InternViT, pixel shuffle,
  projector) with no decoder; every tensor is shared.
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


def _decoder_body(model) -> dict[str, torch.Tensor]:
    """Our decoder's parameters but the LM head, under a transformers text model's names."""
    return {name: p for name, p in model.language_model.named_parameters() if not name.startswith("lm_head")}


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


class MRopeTextTwin:
    """A transformers M-RoPE text model (``Qwen3VLTextModel``, ``Qwen2_5_VLTextModel``) and our LM
    head: the decoder's prefill, with DeepStack features when ``deepstack_layers`` > 0."""

    def __init__(self, text_model, lm_head: torch.Tensor, hidden: int, deepstack_layers: int = 0) -> None:
        self.text_model, self.lm_head = text_model, lm_head
        self.hidden, self.deepstack_layers = hidden, deepstack_layers

    def prefill(self, inputs: DecoderInputs) -> Callable[[], torch.Tensor]:
        """Embeddings [1, n, hidden] and positions [3, 1, n]; with DeepStack, the visual mask [1, n]
        and one [n_visual, hidden] feature per layer too, as ``Qwen3VLModel`` hands them to its text
        model."""
        h = self.hidden
        embeds = inputs.embeds[None, :, :h]
        positions = inputs.rope.to(torch.long)[:, None, :]
        extra = {}
        if self.deepstack_layers:
            visual = inputs.embeds[inputs.visual]
            extra = {"visual_pos_masks": inputs.visual[None],
                     "deepstack_visual_embeds": [visual[:, h * (i + 1): h * (i + 2)]
                                                 for i in range(self.deepstack_layers)]}

        def run() -> torch.Tensor:
            out = self.text_model(inputs_embeds=embeds, position_ids=positions, use_cache=True, **extra)
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


def qwen3vl_twin(model) -> MRopeTextTwin:
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
    params = _decoder_body(model) | _heads_in_original_order(model)
    text_model.load_state_dict(params, strict=True, assign=True)
    text_model.rotary_emb = Qwen3VLTextRotaryEmbedding(config).to(model.device)  # built off meta: real inv_freq
    text_model.eval().requires_grad_(False)
    return MRopeTextTwin(text_model, model.language_model.lm_head.weight, c.hidden, c.deepstack_layers)


def qwen25vl_twin(model) -> MRopeTextTwin:
    """transformers' ``Qwen2_5_VLTextModel`` (SDPA) sharing ``model``'s decoder tensors, and its LM head."""
    require("transformers", **TWIN)
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, Qwen2_5_VLTextModel

    c = model.config
    if c.head_dim * c.n_heads != c.hidden or c.rope.interleaved or len(c.rope.sections) != 3:
        raise ValueError("Qwen2_5_VLTextModel takes head_dim = hidden / heads and contiguous M-RoPE sections")
    config = Qwen2_5_VLTextConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.context_length, use_sliding_window=False, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, attn_implementation="sdpa",
        rope_parameters={"rope_type": "default", "rope_theta": c.rope.theta, "mrope_section": list(c.rope.sections)},
    )
    with torch.device("meta"):
        text_model = Qwen2_5_VLTextModel(config)
    text_model.load_state_dict(_decoder_body(model), strict=True, assign=True)
    text_model.rotary_emb = Qwen2_5_VLRotaryEmbedding(config).to(model.device)  # built off meta: real inv_freq
    text_model.eval().requires_grad_(False)
    return MRopeTextTwin(text_model, model.language_model.lm_head.weight, c.hidden)


@dataclass(frozen=True, slots=True)
class VisionInputs:
    """A batch of images as our vision tower takes them, on the model's device in its dtype.

    pixels: Qwen towers: flattened patches [sum t*h*w, C * 2 * p * p], image after image;
        InternViT: tiles [n_tiles, C, tile, tile].
    grids: Qwen towers: each image's patch grid (t, h, w); InternViT: empty.
    """

    pixels: torch.Tensor
    grids: tuple[tuple[int, int, int], ...] = ()


Encode = Callable[[VisionInputs], Callable[[], torch.Tensor]]


def our_encode(model) -> Encode:
    """Our vision tower and projector (``encode_pixels``): [visual tokens, embedding width]."""

    def encode(inputs: VisionInputs) -> Callable[[], torch.Tensor]:
        if inputs.grids:
            return lambda: model.encode_pixels(inputs.pixels, inputs.grids)
        return lambda: model.encode_pixels(inputs.pixels).flatten(0, 1)

    return encode


def _grid_tensor(inputs: VisionInputs) -> torch.Tensor:
    return torch.tensor(inputs.grids, dtype=torch.long, device=inputs.pixels.device)


def _conv3d_kernel(patch_embed) -> torch.Tensor:
    """Our two frame kernels [E, C, p, p] as the Conv3D's [E, C, 2, p, p] (a copy)."""
    return torch.stack((patch_embed.frame_0, patch_embed.frame_1), dim=2)


def _qwen_tower_parameters(tower) -> dict[str, torch.Tensor]:
    """Our Qwen tower's parameters under transformers' names: the patch embedding as the Conv3D
    ``patch_embed.proj`` and, for a tower with separate q/k/v (Qwen2.5-VL), each block's fused qkv
    (copies); every other tensor shared."""
    out = {}
    for name, p in tower.named_parameters():
        if name.startswith("patch_embed."):
            continue
        module, _, suffix = name.rpartition(".")
        if module.endswith(".attn.q"):  # rows q | k | v, as transformers' fused projection
            block = module[: -len(".q")]
            parts = [tower.get_parameter(f"{block}.{part}.{suffix}") for part in ("q", "k", "v")]
            out[f"{block}.qkv.{suffix}"] = torch.cat(parts)
        elif not (module.endswith(".attn.k") or module.endswith(".attn.v")):
            out[name] = p
    out["patch_embed.proj.weight"] = _conv3d_kernel(tower.patch_embed)
    if getattr(tower.patch_embed, "bias", None) is not None:
        out["patch_embed.proj.bias"] = tower.patch_embed.bias
    return out


def qwen25vl_vision_twin(model) -> Encode:
    """transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (SDPA) with ``model``'s tower tensors."""
    require("transformers", **TWIN)
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
        Qwen2_5_VLVisionRotaryEmbedding,
    )

    v = model.visual.config
    config = Qwen2_5_VLVisionConfig(
        depth=v.num_hidden_layers, hidden_size=v.hidden_size, hidden_act=v.hidden_act,
        intermediate_size=v.intermediate_size, num_heads=v.num_attention_heads, in_channels=v.num_channels,
        patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
        window_size=v.window_size, out_hidden_size=v.projection_dim,
        fullatt_block_indexes=list(v.fullatt_block_indexes),
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta}, attn_implementation="sdpa",
    )
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel(config)
    tower.load_state_dict(_qwen_tower_parameters(model.visual), strict=True, assign=True)
    tower.rotary_pos_emb = Qwen2_5_VLVisionRotaryEmbedding(config).to(model.device)  # built off meta
    tower.eval().requires_grad_(False)

    def encode(inputs: VisionInputs) -> Callable[[], torch.Tensor]:
        grids = _grid_tensor(inputs)
        return lambda: tower(inputs.pixels, grid_thw=grids).pooler_output

    return encode


def qwen3vl_vision_twin(model) -> Encode:
    """transformers' ``Qwen3VLVisionModel`` (SDPA) with ``model``'s tower tensors: the merged
    embeddings, then each DeepStack feature."""
    require("transformers", **TWIN)
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel, Qwen3VLVisionRotaryEmbedding

    v = model.visual.config
    config = Qwen3VLVisionConfig(
        depth=v.num_hidden_layers, hidden_size=v.hidden_size, hidden_act=v.hidden_act,
        intermediate_size=v.intermediate_size, num_heads=v.num_attention_heads, in_channels=v.num_channels,
        patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
        out_hidden_size=v.projection_dim, num_position_embeddings=v.num_position_embeddings,
        deepstack_visual_indexes=list(v.deepstack_visual_indexes),
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta}, attn_implementation="sdpa",
    )
    with torch.device("meta"):
        tower = Qwen3VLVisionModel(config)
    tower.load_state_dict(_qwen_tower_parameters(model.visual), strict=True, assign=True)
    tower.rotary_pos_emb = Qwen3VLVisionRotaryEmbedding(config).to(model.device)  # built off meta
    tower.eval().requires_grad_(False)

    def encode(inputs: VisionInputs) -> Callable[[], torch.Tensor]:
        grids = _grid_tensor(inputs)

        def run() -> torch.Tensor:
            out = tower(inputs.pixels, grid_thw=grids)
            return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

        return run

    return encode


# our InternViT / projector parameter name pieces -> transformers' InternVLModel names
_INTERNVIT_NAMES = (
    ("patch_embedding.", "vision_tower.embeddings.patch_embeddings.projection."),
    ("class_embedding", "vision_tower.embeddings.cls_token"),
    ("position_embedding", "vision_tower.embeddings.position_embeddings"),
    ("layers.", "vision_tower.encoder.layer."),
)
_INTERNVIT_LAYER_NAMES = {"layer_norm1": "layernorm_before", "layer_norm2": "layernorm_after",
                          "layer_scale1": "lambda_1", "layer_scale2": "lambda_2", "self_attn.out_proj":
                          "attention.projection_layer", "self_attn.q_proj": "attention.q_proj",
                          "self_attn.k_proj": "attention.k_proj", "self_attn.v_proj": "attention.v_proj"}


def _internvit_name(name: str) -> str:
    """Our ``InternVisionTower`` parameter name -> transformers' ``InternVLModel`` one."""
    for ours, theirs in _INTERNVIT_NAMES:
        if name.startswith(ours):
            name = theirs + name[len(ours):]
            break
    for ours, theirs in _INTERNVIT_LAYER_NAMES.items():
        name = name.replace(f".{ours}", f".{theirs}")
    return name


def internvl_vision_twin(model) -> Encode:
    """transformers' ``InternVLModel.get_image_features`` (InternViT with SDPA, pixel shuffle,
    projector) with ``model``'s tower and projector tensors; the twin holds no decoder."""
    require("transformers", **TWIN)
    from transformers import InternVLConfig, InternVLModel

    v = model.vision_tower.config
    c = model.config
    config = InternVLConfig(
        vision_config={"hidden_size": v.hidden_size, "num_hidden_layers": v.num_hidden_layers,
                       "num_attention_heads": v.num_attention_heads, "intermediate_size": v.intermediate_size,
                       "hidden_act": v.hidden_act, "layer_norm_eps": v.layer_norm_eps, "attention_bias": True,
                       "use_qk_norm": False, "use_mean_pooling": True, "num_channels": v.num_channels,
                       "image_size": [v.image_size] * 2, "patch_size": [v.patch_size] * 2},
        text_config={"model_type": "qwen2", "hidden_size": c.hidden, "num_hidden_layers": 1,
                     "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
                     "intermediate_size": c.intermediate, "vocab_size": c.vocab, "bos_token_id": c.bos_token_id,
                     "eos_token_id": c.eos_token_id},
        downsample_ratio=1 / v.scale_factor, projector_hidden_act=v.projector_hidden_act,
        vision_feature_layer=-1, vision_feature_select_strategy="default", attn_implementation="sdpa",
    )
    with torch.device("meta"):
        twin = InternVLModel(config)
    del twin.language_model  # image features only
    params = {_internvit_name(name): p for name, p in model.vision_tower.named_parameters()}
    params |= {f"multi_modal_projector.{name}": p for name, p in model.multi_modal_projector.named_parameters()}
    twin.load_state_dict(params, strict=True, assign=True)
    twin.eval().requires_grad_(False)

    def encode(inputs: VisionInputs) -> Callable[[], torch.Tensor]:
        return lambda: twin.get_image_features(inputs.pixels, vision_feature_layer=-1,
                                               vision_feature_select_strategy="default").pooler_output.flatten(0, 1)

    return encode
