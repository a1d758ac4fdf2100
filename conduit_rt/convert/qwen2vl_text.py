"""The Qwen2 decoder of Qwen2-VL / Qwen2.5-VL -> ``model.gguf`` (llama.cpp architecture "qwen2vl").

A Qwen2 decoder is a Llama with q/k/v biases (no o_proj bias) and M-RoPE: the rotary frequencies
are split in (t, h, w) sections, written as ``qwen2vl.rope.dimension_sections`` padded with zeros
to four entries, as llama.cpp's ``Qwen2VLModel`` does. Unlike Llama, llama.cpp does not permute the
q/k rows of Qwen2 (its M-RoPE is rotate-half already), so tensors are written as they are stored.
The keys are llama_text's with the "qwen2vl" prefix (``GGUFWriter`` fills ``{arch}`` in). Qwen3-VL's
decoder ("qwen3vl") is written by the same functions: its config adds the q/k norm tensors and
``qwen3vl.n_deepstack_layers``.
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
from .llama_text import add_text_keys
from .source import SourceCheckpoint
from .tokenizer_meta import TokenizerMeta

# transformers' Qwen2VLTextConfig / Qwen2_5_VLTextConfig defaults (hub configs spell most of them out).
QWEN2VL_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "use_sliding_window": False, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": None,
}
DEFAULT_MROPE_SECTION = (16, 24, 24)
# text architecture -> (gguf's architecture for its tensor names, the family named in errors)
_GGUF_ARCHITECTURES = {names.QWEN2VL_ARCH: (MODEL_ARCH.QWEN2VL, "Qwen2-VL"),
                       names.QWEN2_ARCH: (MODEL_ARCH.QWEN2, "Qwen2"),  # InternVL3's decoder
                       names.QWEN3VL_ARCH: (MODEL_ARCH.QWEN3VL, "Qwen3-VL")}
_SUB_CONFIGS = ("text_config", "vision_config")


def qwen2vl_text_hparams(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The text hyperparameters: top-level keys (the hub's older layout) overridden by ``text_config``
    (transformers 5's), defaults filled in. Refuses what the runtime cannot run."""
    top = {key: value for key, value in hf_config.items() if key not in _SUB_CONFIGS}
    text = top | (hf_config.get("text_config") or {})
    hparams = QWEN2VL_TEXT_DEFAULTS | {key: value for key, value in text.items() if value is not None}
    # transformers ties the embeddings when either level asks for it
    hparams["tie_word_embeddings"] = bool(top.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    if hparams["hidden_act"] != "silu":
        raise UnsupportedArchitectureError(f"Qwen2 decoder with hidden_act={hparams['hidden_act']!r} is not supported")
    if hparams["use_sliding_window"]:
        raise UnsupportedArchitectureError("Qwen2 decoder with use_sliding_window=true is not supported")
    hparams["num_key_value_heads"] = hparams["num_key_value_heads"] or hparams["num_attention_heads"]
    # Qwen2-VL's attention ignores a head_dim entry: it is always hidden_size / num_attention_heads
    hparams["head_dim"] = hparams["hidden_size"] // hparams["num_attention_heads"]
    return hparams


def mrope_settings(hparams: dict[str, Any]) -> tuple[float, tuple[int, ...]]:
    """(theta, M-RoPE sections) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta``."""
    parameters = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise UnsupportedArchitectureError(f"Qwen2-VL RoPE type {kind!r} is not supported (supported: default, mrope)")
    theta = float(parameters.get("rope_theta", hparams["rope_theta"]))
    return theta, tuple(int(count) for count in parameters.get("mrope_section", DEFAULT_MROPE_SECTION))


def qwen2vl_text_config(
    hparams: dict[str, Any], tokenizer: TokenizerMeta, *, image_token_id: int, source_id: str,
    source_config: dict[str, Any], architecture: str = names.QWEN2VL_ARCH, num_deepstack_layers: int = 0,
) -> TextModelConfig:
    """The conduit-rt text config (validated at construction) of a Qwen2-VL decoder (``architecture``
    "qwen3vl": Qwen3-VL's, with ``num_deepstack_layers``)."""
    theta, sections = mrope_settings(hparams)
    return TextModelConfig(
        architecture=architecture, vocab_size=len(tokenizer.tokens), hidden_size=hparams["hidden_size"],
        intermediate_size=hparams["intermediate_size"], num_hidden_layers=hparams["num_hidden_layers"],
        num_attention_heads=hparams["num_attention_heads"], num_key_value_heads=hparams["num_key_value_heads"],
        head_dim=hparams["head_dim"], rms_norm_eps=float(hparams["rms_norm_eps"]), rope_theta=theta,
        rope_scaling_type=None, rope_scaling_factor=1.0, max_position_embeddings=hparams["max_position_embeddings"],
        tie_word_embeddings=hparams["tie_word_embeddings"], bos_token_id=tokenizer.special_ids["bos"],
        eos_token_id=tokenizer.special_ids["eos"], pad_token_id=tokenizer.special_ids["pad"],
        unk_token_id=tokenizer.special_ids["unk"], image_token_id=image_token_id, add_bos_token=tokenizer.add_bos,
        add_eos_token=tokenizer.add_eos, tokens=tuple(tokenizer.tokens), chat_template=tokenizer.chat_template,
        tokenizer_json=tokenizer.tokenizer_json, source_id=source_id, source_config=source_config,
        rope_sections=sections, num_deepstack_layers=num_deepstack_layers,
    )


def plan_text_tensors(
    source: SourceCheckpoint, stored_names: dict[str, str], config: TextModelConfig, dtype: OutputDtype,
) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per GGUF tensor, in ``config.tensor_shapes`` order, rows as stored.

    ``stored_names`` maps ``Qwen2ForCausalLM``-style names (``model.layers.0.self_attn.q_proj.bias``,
    ``lm_head.weight``) to the names stored in the checkpoint.
    """
    arch, family = _GGUF_ARCHITECTURES[config.architecture]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    expected = config.tensor_shapes()
    tied = config.tie_word_embeddings
    found = named_tensors(source.root, stored_names, name_map, expected, family,
                          lambda hf_name: hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"))
    return plan_tensors(source.root, found, expected, "text", dtype, source.shape,
                        lambda stored, gguf_name: lambda: source.tensor(stored))


def write_text_model(
    path: Path, config: TextModelConfig, tokenizer: TokenizerMeta, tensors: list[PlannedTensor], *,
    dtype: OutputDtype, model_name: str, source_config_text: str, progress: bool,
) -> Path:
    def add_keys(writer: GGUFWriter) -> None:
        add_text_keys(writer, config, tokenizer, dtype, model_name)
        writer.add_rope_dimension_sections([*config.rope_sections, 0])  # llama.cpp reads four entries
        if config.architecture == names.QWEN3VL_ARCH:
            writer.add_num_deepstack_layers(config.num_deepstack_layers)
        writer.add_string(names.ConduitKeys.SOURCE_CONFIG, source_config_text)

    return write_gguf(path, config.architecture, add_keys, tensors, progress=progress)


__all__ = ["mrope_settings", "plan_text_tensors", "qwen2vl_text_config", "qwen2vl_text_hparams", "write_text_model"]
