"""GGUF names, keys and layouts shared by the converter (writer) and the loader (reader).

One source of truth for both sides: llama.cpp's conventions (taken from the ``gguf`` package's
own constants wherever it has them) plus the few ``conduit.*`` keys llama.cpp has no name for.

Two files per model, as in llama.cpp:

- ``model.gguf``: the text decoder, ``general.architecture = "llama"``, ``llama.*`` hyperparameters,
  tensors ``token_embd``, ``blk.N.*``, ``output_norm``, ``output`` and the tokenizer
  (``tokenizer.ggml.*``, ``tokenizer.huggingface.json``, ``tokenizer.chat_template``).
- ``mmproj.gguf``: vision tower + projector, ``general.architecture = "clip"``,
  ``general.type = "mmproj"``, ``clip.*`` keys, tensors ``v.*`` and ``mm.N.*``.

Layout difference to Hugging Face, stated once: llama.cpp stores the rows of Llama's ``attn_q`` and
``attn_k`` (weights and biases) permuted for its interleaved ("GPT-J style") RoPE; Hugging Face
and conduit-rt use rotate-half RoPE. The converter applies ``llama_rope_permute`` exactly where
llama.cpp's ``LlamaModel.modify_tensors`` does (q_proj with the query head count, k_proj with the
key/value head count); the loader undoes it with ``llama_rope_unpermute``, so the rest of
conduit-rt only ever sees Hugging Face row order.
"""
from __future__ import annotations

import gguf
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGUFType, Keys

TEXT_FILE_NAME = "model.gguf"
MMPROJ_FILE_NAME = "mmproj.gguf"

LLAMA_ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA]  # "llama"
CLIP_ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ]  # "clip"
TYPE_MODEL = GGUFType.MODEL  # "model"
TYPE_MMPROJ = GGUFType.MMPROJ  # "mmproj"
PROJECTOR_MLP = gguf.VISION_PROJECTOR_TYPE_NAMES[gguf.VISION_PROJECTOR_TYPE.MLP]  # "mlp" (LLaVA-1.5)
QWEN2VL_ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2VL]  # "qwen2vl": Qwen2 decoder with M-RoPE
PROJECTOR_QWEN2VL = gguf.VisionProjectorType.QWEN2VL  # "qwen2vl_merger"
PROJECTOR_QWEN25VL = gguf.VisionProjectorType.QWEN25VL  # "qwen2.5vl_merger"
QWEN_PROJECTORS = (PROJECTOR_QWEN2VL, PROJECTOR_QWEN25VL)
QWEN3VL_ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3VL]  # "qwen3vl": Qwen3 decoder, interleaved M-RoPE, DeepStack
PROJECTOR_QWEN3VL = gguf.VisionProjectorType.QWEN3VL  # "qwen3vl_merger"
PATCH_EMBD_FRAME_1 = "v.patch_embd.weight.1"  # second temporal slice of Qwen's Conv3D patch embedding
QWEN2_ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2]  # "qwen2": Qwen2 decoder with 1-D RoPE (InternVL3's)
PROJECTOR_INTERNVL = gguf.VisionProjectorType.INTERNVL  # "internvl": InternViT, pixel shuffle, LN + MLP


class ConduitKeys:
    """Keys llama.cpp has no name for. llama.cpp ignores unknown keys, so files stay loadable there."""

    SOURCE_ID = "conduit.source_id"  # str: fingerprint of the source checkpoint, same in both files
    SOURCE_CONFIG = "conduit.source_config"  # str: the source's config.json, verbatim
    IMAGE_TOKEN_ID = "conduit.image_token_id"  # uint32 (text file): the <image> placeholder token
    FEATURE_LAYER = "conduit.vision.feature_layer"  # int32: HF vision_feature_layer (e.g. -2)
    FEATURE_SELECT = "conduit.vision.feature_select_strategy"  # str: "default" drops CLS, "full"
    VISION_HIDDEN_ACT = "conduit.vision.hidden_act"  # str: e.g. "quick_gelu" (CLIP ViT-L)
    PROJECTOR_HIDDEN_ACT = "conduit.projector.hidden_act"  # str: e.g. "gelu"
    PREPROCESSOR_CONFIG = "clip.vision.preprocessor_config"  # str: preprocessor_config.json
    PROCESSOR_CONFIG = "conduit.vision.processor_config"  # str: processor_config.json ("{}" if none)
    FULLATT_BLOCKS = "conduit.vision.fullatt_block_indexes"  # int32[]: Qwen2.5-VL full-attention blocks
    VISION_ROPE_THETA = "conduit.vision.rope_theta"  # float32: base of the vision tower's 2-D RoPE
    EOS_TOKEN_IDS = "conduit.eos_token_ids"  # uint32[] (text file): every id that ends an answer


def llm_key(template: str, arch: str = LLAMA_ARCH) -> str:
    """A ``{arch}.*`` key of ``gguf.Keys`` filled in, e.g. ``llm_key(Keys.LLM.BLOCK_COUNT)``."""
    return template.format(arch=arch)


def tensor_name(kind: MODEL_TENSOR, suffix: str | None = "weight", layer: int | None = None) -> str:
    """The GGUF tensor name of ``kind`` (``gguf.TENSOR_NAMES``), e.g. ``blk.3.attn_q.weight``."""
    base = TENSOR_NAMES[kind]
    if "{bid}" in base:
        if layer is None:
            raise ValueError(f"tensor {base} needs a layer index")
        base = base.format(bid=layer)
    return f"{base}.{suffix}" if suffix else base


def llama_text_tensor_shapes(
    *, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
    num_heads: int, num_kv_heads: int, head_dim: int, tie_word_embeddings: bool,
) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama ``model.gguf`` and its shape in HF convention (linear: [out, in]).

    =================================  ==================  ======================================
    GGUF name                          shape               Hugging Face LlamaForCausalLM
    =================================  ==================  ======================================
    token_embd.weight                  [vocab, hidden]     model.embed_tokens.weight
    blk.N.attn_norm.weight             [hidden]            model.layers.N.input_layernorm.weight
    blk.N.attn_q.weight                [H*d, hidden]       ...self_attn.q_proj.weight
    blk.N.attn_k.weight                [H_kv*d, hidden]    ...self_attn.k_proj.weight
    blk.N.attn_v.weight                [H_kv*d, hidden]    ...self_attn.v_proj.weight
    blk.N.attn_output.weight           [hidden, H*d]       ...self_attn.o_proj.weight
    blk.N.ffn_norm.weight              [hidden]            ...post_attention_layernorm.weight
    blk.N.ffn_gate.weight              [inter, hidden]     ...mlp.gate_proj.weight
    blk.N.ffn_up.weight                [inter, hidden]     ...mlp.up_proj.weight
    blk.N.ffn_down.weight              [hidden, inter]     ...mlp.down_proj.weight
    output_norm.weight                 [hidden]            model.norm.weight
    output.weight                      [vocab, hidden]     lm_head.weight (absent when tied)
    =================================  ==================  ======================================
    """
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    shapes = {tensor_name(MODEL_TENSOR.TOKEN_EMBD): (vocab_size, hidden_size)}
    per_layer = {
        MODEL_TENSOR.ATTN_NORM: (hidden_size,),
        MODEL_TENSOR.ATTN_Q: (q_rows, hidden_size),
        MODEL_TENSOR.ATTN_K: (kv_rows, hidden_size),
        MODEL_TENSOR.ATTN_V: (kv_rows, hidden_size),
        MODEL_TENSOR.ATTN_OUT: (hidden_size, q_rows),
        MODEL_TENSOR.FFN_NORM: (hidden_size,),
        MODEL_TENSOR.FFN_GATE: (intermediate_size, hidden_size),
        MODEL_TENSOR.FFN_UP: (intermediate_size, hidden_size),
        MODEL_TENSOR.FFN_DOWN: (hidden_size, intermediate_size),
    }
    for layer in range(num_layers):
        for kind, shape in per_layer.items():
            shapes[tensor_name(kind, layer=layer)] = shape
    shapes[tensor_name(MODEL_TENSOR.OUTPUT_NORM)] = (hidden_size,)
    if not tie_word_embeddings:
        shapes[tensor_name(MODEL_TENSOR.OUTPUT)] = (vocab_size, hidden_size)
    return shapes


def llama_attention_bias_shapes(*, num_layers: int, hidden_size: int, q_rows: int, kv_rows: int) -> dict[str, tuple[int, ...]]:
    """Optional ``blk.N.attn_{q,k,v,output}.bias`` tensors (Llama with ``attention_bias=True``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(num_layers):
        shapes[tensor_name(MODEL_TENSOR.ATTN_Q, "bias", layer)] = (q_rows,)
        shapes[tensor_name(MODEL_TENSOR.ATTN_K, "bias", layer)] = (kv_rows,)
        shapes[tensor_name(MODEL_TENSOR.ATTN_V, "bias", layer)] = (kv_rows,)
        shapes[tensor_name(MODEL_TENSOR.ATTN_OUT, "bias", layer)] = (hidden_size,)
    return shapes


def internvl_mmproj_tensor_shapes(
    *, hidden_size: int, intermediate_size: int, num_layers: int, num_channels: int, patch_size: int,
    num_positions: int, scale_factor: int, projection_dim: int,
) -> dict[str, tuple[int, ...]]:
    """Every tensor of an InternVL ``mmproj.gguf`` (InternViT + pixel shuffle + MLP, projector "internvl").

    =================================  =====================  ==========================================
    GGUF name                          shape                  Hugging Face InternVLForConditionalGeneration
    =================================  =====================  ==========================================
    v.patch_embd.{weight,bias}         [E, C, p, p] / [E]     vision_tower.embeddings.patch_embeddings.projection
    v.class_embd                       [1, 1, E]              embeddings.cls_token
    v.position_embd.weight             [1, n_patches+1, E]    embeddings.position_embeddings
    v.blk.N.ln1.{weight,bias}          [E]                    encoder.layer.N.layernorm_before
    v.blk.N.attn_q/k/v.{weight,bias}   [E, E] / [E]           ...attention.q_proj / k_proj / v_proj
    v.blk.N.attn_out.{weight,bias}     [E, E] / [E]           ...attention.projection_layer
    v.blk.N.ls1.weight                 [E]                    ...lambda_1 (attention layer scale)
    v.blk.N.ln2.{weight,bias}          [E]                    ...layernorm_after
    v.blk.N.ffn_up.{weight,bias}       [I, E] / [I]           ...mlp.fc1
    v.blk.N.ffn_down.{weight,bias}     [E, I] / [E]           ...mlp.fc2
    v.blk.N.ls2.weight                 [E]                    ...lambda_2 (MLP layer scale)
    mm.0.{weight,bias}                 [E s^2]                multi_modal_projector.layer_norm
    mm.1.{weight,bias}                 [proj, E s^2] / [proj] multi_modal_projector.linear_1
    mm.3.{weight,bias}                 [proj, proj] / [proj]  multi_modal_projector.linear_2
    =================================  =====================  ==========================================

    ``mm.0``/``mm.1``/``mm.3`` are the indices of the original InternVL ``mlp1`` ``nn.Sequential``
    (LayerNorm, Linear, GELU, Linear), which is what llama.cpp's "internvl" projector loads; ``s`` is
    the pixel-shuffle factor (``clip.vision.projector.scale_factor``, 2 for a downsample ratio of 0.5).
    The CLS token and the position embeddings keep their leading 1s, as llama.cpp writes them.
    """
    shuffled = hidden_size * scale_factor**2
    shapes: dict[str, tuple[int, ...]] = {
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH): (hidden_size, num_channels, patch_size, patch_size),
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH, "bias"): (hidden_size,),
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_CLS, suffix=None): (1, 1, hidden_size),
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_POS): (1, num_positions, hidden_size),
    }
    linear = _vision_block_linears(hidden_size, intermediate_size)
    for layer in range(num_layers):
        for kind in (MODEL_TENSOR.V_ENC_INPUT_NORM, MODEL_TENSOR.V_ENC_POST_ATTN_NORM):
            for suffix in ("weight", "bias"):
                shapes[tensor_name(kind, suffix, layer)] = (hidden_size,)
        for kind, (rows, cols) in linear.items():
            shapes[tensor_name(kind, "weight", layer)] = (rows, cols)
            shapes[tensor_name(kind, "bias", layer)] = (rows,)
        for kind in (MODEL_TENSOR.V_LAYER_SCALE_1, MODEL_TENSOR.V_LAYER_SCALE_2):
            shapes[tensor_name(kind, "weight", layer)] = (hidden_size,)
    for suffix in ("weight", "bias"):
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, suffix, 0)] = (shuffled,)
    for index, in_features in ((1, shuffled), (3, projection_dim)):
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "weight", index)] = (projection_dim, in_features)
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "bias", index)] = (projection_dim,)
    return shapes


def _vision_block_linears(hidden_size: int, intermediate_size: int) -> dict:
    """The shapes ([out, in]) of a ViT block's attention and MLP projections, by tensor kind."""
    return {
        MODEL_TENSOR.V_ENC_ATTN_Q: (hidden_size, hidden_size),
        MODEL_TENSOR.V_ENC_ATTN_K: (hidden_size, hidden_size),
        MODEL_TENSOR.V_ENC_ATTN_V: (hidden_size, hidden_size),
        MODEL_TENSOR.V_ENC_ATTN_O: (hidden_size, hidden_size),
        MODEL_TENSOR.V_ENC_FFN_UP: (intermediate_size, hidden_size),
        MODEL_TENSOR.V_ENC_FFN_DOWN: (hidden_size, intermediate_size),
    }


def clip_mlp_mmproj_tensor_shapes(
    *, hidden_size: int, intermediate_size: int, num_layers: int, num_channels: int,
    patch_size: int, num_positions: int, projection_dim: int,
) -> dict[str, tuple[int, ...]]:
    """Every tensor of a LLaVA-1.5 ``mmproj.gguf`` (CLIP ViT + 2-layer MLP, projector "mlp").

    =================================  =====================  ==========================================
    GGUF name                          shape                  Hugging Face LlavaForConditionalGeneration
    =================================  =====================  ==========================================
    v.patch_embd.weight                [hidden, C, p, p]      vision_tower embeddings.patch_embedding
    v.class_embd                       [hidden]               embeddings.class_embedding
    v.position_embd.weight             [n_patches+1, hidden]  embeddings.position_embedding.weight
    v.pre_ln.{weight,bias}             [hidden]               pre_layrnorm
    v.blk.N.attn_q.{weight,bias}       [hidden, hidden]/[h]   encoder.layers.N.self_attn.q_proj
    v.blk.N.attn_k / attn_v            same                   ...k_proj / v_proj
    v.blk.N.attn_out.{weight,bias}     [hidden, hidden]/[h]   ...self_attn.out_proj
    v.blk.N.ln1.{weight,bias}          [hidden]               ...layer_norm1
    v.blk.N.ffn_up.{weight,bias}       [inter, hidden]/[i]    ...mlp.fc1
    v.blk.N.ffn_down.{weight,bias}     [hidden, inter]/[h]    ...mlp.fc2
    v.blk.N.ln2.{weight,bias}          [hidden]               ...layer_norm2
    mm.0.{weight,bias}                 [proj, hidden]/[proj]  multi_modal_projector.linear_1
    mm.2.{weight,bias}                 [proj, proj]/[proj]    multi_modal_projector.linear_2
    =================================  =====================  ==========================================

    ``mm.0``/``mm.2`` are the indices of the original LLaVA ``nn.Sequential`` (Linear, GELU, Linear),
    which is what llama.cpp's "mlp" projector loads. Only the blocks that feed the projector are
    stored (llama.cpp's LLaVA-1.5 convention): with ``vision_feature_layer = -2`` the last block is
    dropped, and so is ``v.post_ln`` (CLIP applies it to the pooled output only, never to the
    hidden states LLaVA reads). ``num_layers`` is the number of stored blocks.
    """
    shapes: dict[str, tuple[int, ...]] = {
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH): (hidden_size, num_channels, patch_size, patch_size),
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_CLS, suffix=None): (hidden_size,),
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_POS): (num_positions, hidden_size),
        tensor_name(MODEL_TENSOR.V_PRE_NORM, "weight"): (hidden_size,),
        tensor_name(MODEL_TENSOR.V_PRE_NORM, "bias"): (hidden_size,),
    }
    linear = _vision_block_linears(hidden_size, intermediate_size)
    layer_norms = (MODEL_TENSOR.V_ENC_INPUT_NORM, MODEL_TENSOR.V_ENC_POST_ATTN_NORM)
    for layer in range(num_layers):
        for kind, (rows, cols) in linear.items():
            shapes[tensor_name(kind, "weight", layer)] = (rows, cols)
            shapes[tensor_name(kind, "bias", layer)] = (rows,)
        for kind in layer_norms:
            shapes[tensor_name(kind, "weight", layer)] = (hidden_size,)
            shapes[tensor_name(kind, "bias", layer)] = (hidden_size,)
    for index, in_features in ((0, hidden_size), (2, projection_dim)):
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "weight", index)] = (projection_dim, in_features)
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "bias", index)] = (projection_dim,)
    return shapes


def qwen2_attention_bias_shapes(*, num_layers: int, q_rows: int, kv_rows: int) -> dict[str, tuple[int, ...]]:
    """``blk.N.attn_{q,k,v}.bias`` of a Qwen2 decoder (its o_proj has no bias)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(num_layers):
        shapes[tensor_name(MODEL_TENSOR.ATTN_Q, "bias", layer)] = (q_rows,)
        shapes[tensor_name(MODEL_TENSOR.ATTN_K, "bias", layer)] = (kv_rows,)
        shapes[tensor_name(MODEL_TENSOR.ATTN_V, "bias", layer)] = (kv_rows,)
    return shapes


def qwen_vision_mmproj_tensor_shapes(
    *, hidden_size: int, intermediate_size: int, num_layers: int, num_channels: int, patch_size: int,
    merge_size: int, projection_dim: int, gated_mlp: bool, norm_bias: bool,
) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2-VL / Qwen2.5-VL ``mmproj.gguf`` (projectors "qwen2vl_merger", "qwen2.5vl_merger").

    =================================  =====================  ==========================================
    GGUF name                          shape                  Hugging Face ``visual.*``
    =================================  =====================  ==========================================
    v.patch_embd.weight                [E, C, p, p]           patch_embed.proj.weight[:, :, 0] (Conv3D)
    v.patch_embd.weight.1              [E, C, p, p]           patch_embed.proj.weight[:, :, 1]
    v.blk.N.ln1.weight (+.bias: 2)     [E]                    blocks.N.norm1
    v.blk.N.attn_q/k/v.{weight,bias}   [E, E] / [E]           blocks.N.attn.qkv, split in thirds
    v.blk.N.attn_out.{weight,bias}     [E, E] / [E]           blocks.N.attn.proj
    v.blk.N.ln2.weight (+.bias: 2)     [E]                    blocks.N.norm2
    v.blk.N.ffn_up.{weight,bias}       [I, E] / [I]           mlp.fc1 (2) / mlp.up_proj (2.5)
    v.blk.N.ffn_gate.{weight,bias}     [I, E] / [I]           mlp.gate_proj (2.5 only)
    v.blk.N.ffn_down.{weight,bias}     [E, I] / [E]           mlp.fc2 (2) / mlp.down_proj (2.5)
    v.post_ln.weight (+.bias: 2)       [E]                    merger.ln_q
    mm.0.{weight,bias}                 [E m^2, E m^2]         merger.mlp.0
    mm.2.{weight,bias}                 [proj, E m^2]          merger.mlp.2
    =================================  =====================  ==========================================

    Qwen2-VL uses LayerNorm (weight and bias) and a GELU MLP; Qwen2.5-VL RMSNorm (weight only) and
    a gated SiLU MLP (``gated_mlp``). The Conv3D patch embedding is stored as its two temporal
    slices, as llama.cpp does (temporal_patch_size 2).
    """
    merged = hidden_size * merge_size**2
    patch = (hidden_size, num_channels, patch_size, patch_size)
    shapes: dict[str, tuple[int, ...]] = {tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH): patch, PATCH_EMBD_FRAME_1: patch}
    norm_suffixes = ("weight", "bias") if norm_bias else ("weight",)
    linear = _vision_block_linears(hidden_size, intermediate_size)
    if gated_mlp:
        linear[MODEL_TENSOR.V_ENC_FFN_GATE] = (intermediate_size, hidden_size)
    for layer in range(num_layers):
        for kind in (MODEL_TENSOR.V_ENC_INPUT_NORM, MODEL_TENSOR.V_ENC_POST_ATTN_NORM):
            for suffix in norm_suffixes:
                shapes[tensor_name(kind, suffix, layer)] = (hidden_size,)
        for kind, (rows, cols) in linear.items():
            shapes[tensor_name(kind, "weight", layer)] = (rows, cols)
            shapes[tensor_name(kind, "bias", layer)] = (rows,)
    for suffix in norm_suffixes:
        shapes[tensor_name(MODEL_TENSOR.V_POST_NORM, suffix)] = (hidden_size,)
    for index, rows in ((0, merged), (2, projection_dim)):
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "weight", index)] = (rows, merged)
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "bias", index)] = (rows,)
    return shapes


def qwen3_attention_norm_shapes(*, num_layers: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """``blk.N.attn_{q,k}_norm.weight`` [head_dim] of a Qwen3 decoder (RMSNorm of each q/k head)."""
    return {tensor_name(kind, "weight", layer): (head_dim,)
            for layer in range(num_layers) for kind in (MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM)}


def qwen3vl_mmproj_tensor_shapes(
    *, hidden_size: int, intermediate_size: int, num_layers: int, num_channels: int, patch_size: int,
    merge_size: int, projection_dim: int, num_positions: int, deepstack_layers: tuple[int, ...],
) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3-VL ``mmproj.gguf`` (projector "qwen3vl_merger"), as llama.cpp names them.

    =================================  =====================  ==========================================
    GGUF name                          shape                  Hugging Face ``visual.*``
    =================================  =====================  ==========================================
    v.patch_embd.weight / .weight.1    [E, C, p, p]           patch_embed.proj.weight[:, :, 0 / 1]
    v.patch_embd.bias                  [E]                    patch_embed.proj.bias
    v.position_embd.weight             [n_pos, E]             pos_embed.weight (a square grid)
    v.blk.N.ln1 / ln2.{weight,bias}    [E]                    blocks.N.norm1 / norm2 (LayerNorm)
    v.blk.N.attn_qkv.{weight,bias}     [3E, E] / [3E]         blocks.N.attn.qkv (fused, rows q|k|v)
    v.blk.N.attn_out.{weight,bias}     [E, E] / [E]           blocks.N.attn.proj
    v.blk.N.ffn_up / ffn_down          [I, E] / [E, I]        blocks.N.mlp.linear_fc1 / linear_fc2
    v.post_ln.{weight,bias}            [E]                    merger.norm
    mm.0 / mm.2.{weight,bias}          [E m^2, E m^2] / ...   merger.linear_fc1 / linear_fc2
    v.deepstack.N.norm.{weight,bias}   [E m^2]                deepstack_merger_list.i.norm (N: block)
    v.deepstack.N.fc1 / fc2            [E m^2, E m^2] / ...   deepstack_merger_list.i.linear_fc1 / fc2
    =================================  =====================  ==========================================

    A DeepStack merger is numbered by the vision block whose output it reads (llama.cpp's
    convention), not by its place in ``deepstack_merger_list``.
    """
    merged = hidden_size * merge_size**2
    patch = (hidden_size, num_channels, patch_size, patch_size)
    shapes: dict[str, tuple[int, ...]] = {
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH): patch, PATCH_EMBD_FRAME_1: patch,
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH, "bias"): (hidden_size,),
        tensor_name(MODEL_TENSOR.V_ENC_EMBD_POS): (num_positions, hidden_size),
    }
    linear = {
        MODEL_TENSOR.V_ENC_ATTN_QKV: (3 * hidden_size, hidden_size),
        MODEL_TENSOR.V_ENC_ATTN_O: (hidden_size, hidden_size),
        MODEL_TENSOR.V_ENC_FFN_UP: (intermediate_size, hidden_size),
        MODEL_TENSOR.V_ENC_FFN_DOWN: (hidden_size, intermediate_size),
    }
    for layer in range(num_layers):
        for kind in (MODEL_TENSOR.V_ENC_INPUT_NORM, MODEL_TENSOR.V_ENC_POST_ATTN_NORM):
            for suffix in ("weight", "bias"):
                shapes[tensor_name(kind, suffix, layer)] = (hidden_size,)
        for kind, (rows, cols) in linear.items():
            shapes[tensor_name(kind, "weight", layer)] = (rows, cols)
            shapes[tensor_name(kind, "bias", layer)] = (rows,)
    for suffix in ("weight", "bias"):
        shapes[tensor_name(MODEL_TENSOR.V_POST_NORM, suffix)] = (hidden_size,)
    for index, rows in ((0, merged), (2, projection_dim)):
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "weight", index)] = (rows, merged)
        shapes[tensor_name(MODEL_TENSOR.V_MMPROJ, "bias", index)] = (rows,)
    for layer in deepstack_layers:
        for kind, rows in ((MODEL_TENSOR.V_DS_FC1, merged), (MODEL_TENSOR.V_DS_FC2, projection_dim)):
            shapes[tensor_name(kind, "weight", layer)] = (rows, merged)
            shapes[tensor_name(kind, "bias", layer)] = (rows,)
        for suffix in ("weight", "bias"):
            shapes[tensor_name(MODEL_TENSOR.V_DS_NORM, suffix, layer)] = (merged,)
    return shapes


_QWEN3VL_BLOCK_TENSORS = {
    "norm1": MODEL_TENSOR.V_ENC_INPUT_NORM, "norm2": MODEL_TENSOR.V_ENC_POST_ATTN_NORM,
    "attn.qkv": MODEL_TENSOR.V_ENC_ATTN_QKV, "attn.proj": MODEL_TENSOR.V_ENC_ATTN_O,
    "mlp.linear_fc1": MODEL_TENSOR.V_ENC_FFN_UP, "mlp.linear_fc2": MODEL_TENSOR.V_ENC_FFN_DOWN,
}
_QWEN3VL_MERGER_TENSORS = {"norm": MODEL_TENSOR.V_POST_NORM, "linear_fc1": (MODEL_TENSOR.V_MMPROJ, 0),
                           "linear_fc2": (MODEL_TENSOR.V_MMPROJ, 2)}
_QWEN3VL_DEEPSTACK_TENSORS = {"norm": MODEL_TENSOR.V_DS_NORM, "linear_fc1": MODEL_TENSOR.V_DS_FC1,
                              "linear_fc2": MODEL_TENSOR.V_DS_FC2}


def qwen3vl_vision_tensor_name(relative: str, deepstack_indexes: tuple[int, ...]) -> str | None:
    """The GGUF name of a Qwen3-VL ``visual.*`` tensor (``relative`` to ``visual``, e.g.
    ``blocks.0.attn.qkv.weight``; see ``qwen3vl_mmproj_tensor_shapes``), or None for a name that is
    not one. The Conv3D ``patch_embed.proj.weight`` is two GGUF tensors and has no single name."""
    module, _, suffix = relative.rpartition(".")
    parts = module.split(".")
    if module == "patch_embed.proj" and suffix == "bias":
        return tensor_name(MODEL_TENSOR.V_ENC_EMBD_PATCH, "bias")
    if module == "pos_embed" and suffix == "weight":
        return tensor_name(MODEL_TENSOR.V_ENC_EMBD_POS)
    if len(parts) >= 3 and parts[0] == "blocks" and parts[1].isdigit():
        kind = _QWEN3VL_BLOCK_TENSORS.get(".".join(parts[2:]))
        return tensor_name(kind, suffix, int(parts[1])) if kind else None
    if len(parts) == 2 and parts[0] == "merger" and parts[1] in _QWEN3VL_MERGER_TENSORS:
        kind = _QWEN3VL_MERGER_TENSORS[parts[1]]
        return tensor_name(kind[0], suffix, kind[1]) if isinstance(kind, tuple) else tensor_name(kind, suffix)
    if len(parts) == 3 and parts[0] == "deepstack_merger_list" and parts[1].isdigit():
        index, kind = int(parts[1]), _QWEN3VL_DEEPSTACK_TENSORS.get(parts[2])
        if kind and index < len(deepstack_indexes):
            return tensor_name(kind, suffix, deepstack_indexes[index])  # numbered by the block it reads
    return None


_ATTN_Q = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q].split(".")[-1]  # "attn_q"
_ATTN_K = TENSOR_NAMES[MODEL_TENSOR.ATTN_K].split(".")[-1]  # "attn_k"


def is_rope_permuted(name: str) -> bool:
    """True for the text tensors whose rows llama.cpp permutes: ``blk.N.attn_q/attn_k`` weight/bias."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in (_ATTN_Q, _ATTN_K)


def rope_permute_heads(name: str, num_heads: int, num_kv_heads: int) -> int:
    """The head count llama.cpp permutes ``name`` with: H for attn_q, H_kv for attn_k."""
    return num_heads if name.split(".")[2] == _ATTN_Q else num_kv_heads


def llama_rope_permute(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF (rotate-half) row order -> llama.cpp (interleaved) row order.

    rows: [num_heads * head_dim, ...] (a q/k projection weight [out, in] or bias [out]). Within each
    head, HF keeps the two rotation halves apart (x_0..x_{d/2-1} | x_{d/2}..x_{d-1}); llama.cpp
    wants the pairs adjacent (x_0, x_{d/2}, x_1, x_{d/2+1}, ...).
    """
    head_dim = rows.shape[0] // num_heads
    return rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def llama_rope_unpermute(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of ``llama_rope_permute``: llama.cpp row order -> HF row order."""
    head_dim = rows.shape[0] // num_heads
    return rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


__all__ = [
    "CLIP_ARCH",
    "LLAMA_ARCH",
    "MMPROJ_FILE_NAME",
    "MODEL_TENSOR",
    "PATCH_EMBD_FRAME_1",
    "PROJECTOR_INTERNVL",
    "PROJECTOR_MLP",
    "PROJECTOR_QWEN2VL",
    "PROJECTOR_QWEN25VL",
    "PROJECTOR_QWEN3VL",
    "QWEN2VL_ARCH",
    "QWEN2_ARCH",
    "QWEN3VL_ARCH",
    "QWEN_PROJECTORS",
    "TEXT_FILE_NAME",
    "TYPE_MMPROJ",
    "TYPE_MODEL",
    "ConduitKeys",
    "Keys",
    "clip_mlp_mmproj_tensor_shapes",
    "internvl_mmproj_tensor_shapes",
    "is_rope_permuted",
    "llama_attention_bias_shapes",
    "llama_rope_permute",
    "llama_rope_unpermute",
    "llama_text_tensor_shapes",
    "llm_key",
    "qwen2_attention_bias_shapes",
    "qwen3_attention_norm_shapes",
    "qwen3vl_mmproj_tensor_shapes",
    "qwen3vl_vision_tensor_name",
    "qwen_vision_mmproj_tensor_shapes",
    "rope_permute_heads",
    "tensor_name",
]
