"""The tokenizer's GGUF keys: ``tokenizer.ggml.*`` (llama.cpp's view), the whole tokenizer.json, the chat template.

conduit-rt itself tokenizes with ``tokenizer.huggingface.json`` (the ``tokenizers`` library); the
``tokenizer.ggml.*`` arrays are written so that llama.cpp can read the file too. For a BPE model
with byte fallback (Llama's tokenizer.json) that is llama.cpp's "llama" tokenizer: pieces, token
types and scores (-id, which follows the merge priority of SentencePiece-derived vocabularies);
for a byte-level BPE it is "gpt2" with the merges.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gguf import GGUFWriter, Keys, TokenType

from .. import gguf_names as names
from ..errors import ModelFormatError, UnsupportedArchitectureError
from .source import SourceCheckpoint

SPECIAL_TOKEN_KEYS = {
    "bos": Keys.Tokenizer.BOS_ID, "eos": Keys.Tokenizer.EOS_ID, "unk": Keys.Tokenizer.UNK_ID, "pad": Keys.Tokenizer.PAD_ID,
}


@dataclass(frozen=True)
class TokenizerMeta:
    """Everything about the tokenizer that goes into ``model.gguf``."""

    model: str  # tokenizer.ggml.model: "llama" or "gpt2"
    tokens: list[str]  # piece of each id, padded with "[PAD{id}]" up to the model's vocab size
    token_types: list[int]  # gguf.TokenType per id
    scores: list[float]
    merges: list[str]  # "a b" pairs ("gpt2" only)
    special_ids: dict[str, int | None]  # "bos"/"eos"/"unk"/"pad" -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    tokenizer_json: str  # tokenizer.json verbatim
    eos_ids: tuple[int, ...] = ()  # generation_config.json's end-of-sequence ids (one or several)


def read_model_tokenizer(source: SourceCheckpoint, text_tensors: dict[str, str], text_hparams: dict[str, Any],
                         embedding_name: str) -> TokenizerMeta:
    """``read_tokenizer`` sized by the text embedding's rows, with the text config's bos/eos/pad ids as
    the fallback. ``text_tensors`` maps Hugging Face text names to stored ones; ``embedding_name``
    is the stored name a missing embedding is reported as (ModelFormatError)."""
    embedding = text_tensors.get("model.embed_tokens.weight")
    if embedding is None:
        raise ModelFormatError(f"{source.root}: no text embedding ({embedding_name})")
    config_ids = {role: text_hparams.get(f"{role}_token_id") for role in ("bos", "eos", "pad")}
    return read_tokenizer(source, source.shape(embedding)[0], config_ids)


def read_tokenizer(source: SourceCheckpoint, vocab_size: int, config_ids: dict[str, int | None]) -> TokenizerMeta:
    """Read tokenizer.json, tokenizer_config.json and the chat template of ``source``.

    ``vocab_size`` is the embedding's row count (llava-hf pads it past the tokenizer, e.g. 32064
    rows for 32002 tokens); ``config_ids`` are the model config's bos/eos/pad ids, the fallback
    when tokenizer_config.json does not name a special token.
    """
    tokenizer_json = source.text_file("tokenizer.json")
    if tokenizer_json is None:
        raise ModelFormatError(f"{source.root}: no tokenizer.json (conduit-rt needs the fast tokenizer file)")
    spec = json.loads(tokenizer_json)
    tokenizer_config = source.json_file("tokenizer_config.json") or {}
    pieces, types = _pieces_and_types(spec, vocab_size, source)
    is_llama = spec["model"].get("byte_fallback", False)
    index = {piece: token_id for token_id, piece in enumerate(pieces)}
    special_ids = {role: _special_id(tokenizer_config, role, index, config_ids.get(role)) for role in SPECIAL_TOKEN_KEYS}
    return TokenizerMeta(
        model="llama" if is_llama else "gpt2",
        tokens=pieces,
        token_types=types,
        scores=[-float(token_id) for token_id in range(len(pieces))],
        merges=[] if is_llama else [_merge_text(merge) for merge in spec["model"].get("merges", [])],
        special_ids=special_ids,
        add_bos=bool(tokenizer_config.get("add_bos_token", is_llama)),
        add_eos=bool(tokenizer_config.get("add_eos_token", False)),
        chat_template=find_chat_template(source, tokenizer_config),
        tokenizer_json=tokenizer_json,
        eos_ids=generation_eos_ids(source, len(pieces)),
    )


def generation_eos_ids(source: SourceCheckpoint, vocab_size: int) -> tuple[int, ...]:
    """generation_config.json's ``eos_token_id`` (an id or a list of ids, as the hub's Qwen repos
    hold: ``<|im_end|>`` and ``<|endoftext|>``); () without the file or the entry."""
    value = (source.json_file("generation_config.json") or {}).get("eos_token_id")
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    if value is not None and not (ids and all(type(i) is int and 0 <= i < vocab_size for i in ids)):
        raise ModelFormatError(f"{source.root}/generation_config.json: eos_token_id {value!r} must be token ids "
                               f"below the vocabulary size {vocab_size}")
    return tuple(dict.fromkeys(ids))


def add_tokenizer_keys(writer: GGUFWriter, meta: TokenizerMeta) -> None:
    writer.add_tokenizer_model(meta.model)
    if meta.model == "gpt2":
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(meta.merges)
    writer.add_token_list(meta.tokens)
    writer.add_token_types(meta.token_types)
    writer.add_token_scores(meta.scores)
    for role, token_id in meta.special_ids.items():
        if token_id is not None:
            writer.add_uint32(SPECIAL_TOKEN_KEYS[role], token_id)
    writer.add_add_bos_token(meta.add_bos)
    writer.add_add_eos_token(meta.add_eos)
    writer.add_string(Keys.Tokenizer.HF_JSON, meta.tokenizer_json)
    if meta.eos_ids:
        writer.add_array(names.ConduitKeys.EOS_TOKEN_IDS, list(meta.eos_ids))
    if meta.chat_template is not None:
        writer.add_chat_template(meta.chat_template)


def find_chat_template(source: SourceCheckpoint, tokenizer_config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json, else processor_config.json."""
    template = source.text_file("chat_template.jinja")
    for holder in (source.json_file("chat_template.json"), tokenizer_config, source.json_file("processor_config.json")):
        if template is None and holder:
            template = holder.get("chat_template")
    if isinstance(template, list):  # named templates: keep the default one
        template = next((item["template"] for item in template if item.get("name") == "default"), None)
    return template


def _pieces_and_types(spec: dict[str, Any], vocab_size: int, source: SourceCheckpoint) -> tuple[list[str], list[int]]:
    model = spec["model"]
    if model.get("type") != "BPE":
        raise UnsupportedArchitectureError(f"{source.root}: tokenizer model {model.get('type')!r} is not supported (BPE only)")
    by_id: dict[int, tuple[str, int]] = {}
    byte_fallback = model.get("byte_fallback", False)
    for piece, token_id in model["vocab"].items():
        is_byte = byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
        by_id[token_id] = (piece, TokenType.BYTE if is_byte else TokenType.NORMAL)
    if model.get("unk_token") in model["vocab"]:
        by_id[model["vocab"][model["unk_token"]]] = (model["unk_token"], TokenType.UNKNOWN)
    for added in spec.get("added_tokens", []):
        kind = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
        if by_id.get(added["id"], ("", None))[1] != TokenType.UNKNOWN:
            by_id[added["id"]] = (added["content"], kind)
    if max(by_id) >= vocab_size:
        raise ModelFormatError(f"{source.root}: tokenizer has id {max(by_id)} but the model has only {vocab_size} embeddings")
    pieces, types = [], []
    for token_id in range(vocab_size):
        piece, kind = by_id.get(token_id, (f"[PAD{token_id}]", TokenType.UNUSED))
        pieces.append(piece)
        types.append(int(kind))
    return pieces, types


def _special_id(tokenizer_config: dict[str, Any], role: str, index: dict[str, int], fallback: int | None) -> int | None:
    token = tokenizer_config.get(f"{role}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and token in index:
        return index[token]
    return fallback


def _merge_text(merge: str | list[str]) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)
