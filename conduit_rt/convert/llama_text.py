"""A Llama decoder (``LlamaForCausalLM`` weights, wherever they sit in a checkpoint) -> ``model.gguf``.

Reusable by every architecture whose text model is a Llama: the caller hands over the text
sub-config, the tensor names already stripped to ``LlamaForCausalLM``'s own (``model.layers.N...``,
``lm_head.weight``) and the tokenizer. Names come from ``gguf.TensorNameMap``; the rows of q_proj
and k_proj (weights and biases) are permuted for llama.cpp's interleaved RoPE exactly as
llama.cpp's ``LlamaModel.modify_tensors`` does (q with H heads, k with H_kv heads); the loader
undoes it (``conduit_rt.gguf_names``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
from gguf import MODEL_ARCH, GGUFWriter

from .. import gguf_names as names
from ..errors import ModelFormatError, UnsupportedArchitectureError
from ..model_config import TextModelConfig
from .gguf_output import OutputDtype, PlannedTensor, named_tensors, plan_tensors, write_gguf
from .source import SourceCheckpoint
from .tokenizer_meta import TokenizerMeta, add_tokenizer_keys

# transformers' LlamaConfig defaults: old config.json files (llava-hf's) leave these out.
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
}
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def llama_hparams(hf_text: dict[str, Any]) -> dict[str, Any]:
    """The text config with LlamaConfig's defaults filled in; refuses what the runtime cannot run."""
    hparams = LLAMA_DEFAULTS | {key: value for key, value in hf_text.items() if value is not None or key not in LLAMA_DEFAULTS}
    if hparams.get("model_type", "llama") != "llama":
        raise UnsupportedArchitectureError(f"text model {hparams['model_type']!r} is not supported (supported: llama)")
    if hparams["hidden_act"] != "silu" or hparams["mlp_bias"]:
        raise UnsupportedArchitectureError(f"Llama with hidden_act={hparams['hidden_act']!r}, mlp_bias={hparams['mlp_bias']} is not supported")
    hparams["num_key_value_heads"] = hparams["num_key_value_heads"] or hparams["num_attention_heads"]
    hparams["head_dim"] = hparams["head_dim"] or hparams["hidden_size"] // hparams["num_attention_heads"]
    return hparams


def rope_settings(hparams: dict[str, Any]) -> tuple[float, str | None, float]:
    """(theta, scaling type or None, factor) from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    parameters = hparams.get("rope_parameters") or {}
    scaling = hparams.get("rope_scaling") or parameters
    theta = float(parameters.get("rope_theta", hparams["rope_theta"]))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return theta, None, 1.0
    if kind == "linear":
        return theta, "linear", float(scaling["factor"])
    raise UnsupportedArchitectureError(f"RoPE scaling {kind!r} is not supported (supported: default, linear)")


def llama_text_config(
    hparams: dict[str, Any], tokenizer: TokenizerMeta, *, image_token_id: int | None, source_id: str,
    source_config: dict[str, Any],
) -> TextModelConfig:
    """The conduit-rt text config (validated at construction) for a Llama decoder."""
    theta, scaling_type, scaling_factor = rope_settings(hparams)
    return TextModelConfig(
        architecture=names.LLAMA_ARCH, vocab_size=len(tokenizer.tokens), hidden_size=hparams["hidden_size"],
        intermediate_size=hparams["intermediate_size"], num_hidden_layers=hparams["num_hidden_layers"],
        num_attention_heads=hparams["num_attention_heads"], num_key_value_heads=hparams["num_key_value_heads"],
        head_dim=hparams["head_dim"], rms_norm_eps=float(hparams["rms_norm_eps"]), rope_theta=theta,
        rope_scaling_type=scaling_type, rope_scaling_factor=scaling_factor,
        max_position_embeddings=hparams["max_position_embeddings"], tie_word_embeddings=bool(hparams["tie_word_embeddings"]),
        bos_token_id=tokenizer.special_ids["bos"], eos_token_id=tokenizer.special_ids["eos"],
        pad_token_id=tokenizer.special_ids["pad"], unk_token_id=tokenizer.special_ids["unk"],
        image_token_id=image_token_id, add_bos_token=tokenizer.add_bos, add_eos_token=tokenizer.add_eos,
        tokens=tuple(tokenizer.tokens), chat_template=tokenizer.chat_template, tokenizer_json=tokenizer.tokenizer_json,
        source_id=source_id, source_config=source_config,
    )


def plan_text_tensors(
    source: SourceCheckpoint, stored_names: dict[str, str], config: TextModelConfig, dtype: OutputDtype,
    *, attention_bias: bool,
) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per GGUF tensor, in ``config.tensor_shapes`` order.

    ``stored_names`` maps ``LlamaForCausalLM`` names (``model.layers.0.self_attn.q_proj.weight``)
    to the names stored in the checkpoint. Every expected tensor must be there with its shape.
    """
    name_map = gguf.get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    expected = config.tensor_shapes(attention_bias=attention_bias)
    tied = config.tie_word_embeddings
    found = named_tensors(source.root, stored_names, name_map, expected, "Llama",
                          lambda hf_name: hf_name.endswith(_SKIPPED_SUFFIXES) or (tied and hf_name == "lm_head.weight"))
    return plan_tensors(source.root, found, expected, "text", dtype, source.shape,
                        lambda stored, gguf_name: _loader(source, stored, gguf_name, config))


def _loader(source: SourceCheckpoint, stored: str, gguf_name: str, config: TextModelConfig):
    if not names.is_rope_permuted(gguf_name):
        return lambda: source.tensor(stored)
    heads = names.rope_permute_heads(gguf_name, config.num_attention_heads, config.num_key_value_heads)
    return lambda: names.llama_rope_permute(source.tensor(stored), heads)


def add_text_keys(writer: GGUFWriter, config: TextModelConfig, tokenizer: TokenizerMeta, dtype: OutputDtype, model_name: str) -> None:
    """llama.cpp's ``general.*`` and ``llama.*`` keys, the tokenizer, and the conduit keys."""
    writer.add_type(names.TYPE_MODEL)
    writer.add_name(model_name)
    writer.add_file_type(dtype.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    if config.rope_scaling_type is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling_factor)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_tokenizer_keys(writer, tokenizer)
    if config.image_token_id is not None:
        writer.add_uint32(names.ConduitKeys.IMAGE_TOKEN_ID, config.image_token_id)
    writer.add_string(names.ConduitKeys.SOURCE_ID, config.source_id)


def write_text_model(
    path: Path, config: TextModelConfig, tokenizer: TokenizerMeta, tensors: list[PlannedTensor], *,
    dtype: OutputDtype, model_name: str, source_config_text: str, progress: bool,
) -> Path:
    def add_keys(writer: GGUFWriter) -> None:
        add_text_keys(writer, config, tokenizer, dtype, model_name)
        writer.add_string(names.ConduitKeys.SOURCE_CONFIG, source_config_text)

    return write_gguf(path, names.LLAMA_ARCH, add_keys, tensors, progress=progress)


__all__ = ["add_text_keys", "llama_hparams", "llama_text_config", "plan_text_tensors", "rope_settings", "write_text_model"]
