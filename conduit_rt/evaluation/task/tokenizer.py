"""The task model's tokenizer: a Llama-style BPE (byte fallback) whose words are single tokens.

Built on the spot, deterministically: BPE merges are trained to completion on the closed word list
of the task ("USER:", " ASSISTANT:", the tags, the colours, " and", each code character after a
space), so every task word is one token and codes split into one token per character
(" K7Q" -> "▁K", "7", "Q"). The pipeline (no normalizer, Metaspace "first" without splitting,
Replace/ByteFallback/Fuse/Strip decoder, BOS post-processor) is the one transformers 5 rebuilds for
``LlamaTokenizerFast``, so the ``tokenizers`` library reading tokenizer.json and transformers agree.
Merges never join across "▁" (task words only start with it), so not splitting gives the same
pieces as splitting on spaces.

The chat template is LLaVA-1.5's conversation format: "USER: <image>\\n... ASSISTANT: ...</s>",
each image part rendered where it appears in the message.

The Llama layout and pipeline (``llama_vocab``, ``llama_tokenizer``) and the files
(``write_tokenizer_files``) serve any BPE trained this way: the tests' tiny tokenizer
(``tests/fixtures/tiny_tokenizer.py``) is built with them from its own corpus.

The Qwen2-VL task model's tokenizer (``build_qwen_tokenizer``) is the same BPE pipeline trained on
``qwen_task_words`` (the task words plus "user", "assistant" and each word without its leading
space, since turns and answers start after a newline), with Qwen's special tokens and no BOS:
``<|im_start|>``, ``<|im_end|>`` (EOS), ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``
and ``<|endoftext|>`` (pad). Its chat template (``QWEN_CHAT_TEMPLATE``) is Qwen2-VL's turn format
without a default system prompt: "<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n", each
image part as "<|vision_start|><|image_pad|><|vision_end|>"; "\\n" is the byte token <0x0A>.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from .generator import CODE_ALPHABET, COLOURS, TAGS

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
IMAGE_TOKEN = "<image>"
PAD = "<pad>"
NUM_BYTE_TOKENS = 256
SPACE = "\u2581"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}"
    "{% for part in parts if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}{{ ' ' }}"
    "{% elif message['role'] == 'user' %}{{ 'USER: ' }}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ ' ' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' }}"
    "{% for part in parts if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{{ eos_token }}"
    "{% else %}{{ raise_exception('Only system, user and assistant roles are supported.') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def task_words() -> list[str]:
    """Every word form the task writes, spaces included ("USER:" follows BOS with no space)."""
    words = ["USER:", " ASSISTANT:", " and", "?", " where", " colours"]
    words += [" " + tag for tag in TAGS] + [" " + colour for colour in COLOURS]
    words += [" " + char for char in CODE_ALPHABET]
    return words


def _train_merges(words: list[str] | None = None) -> Tokenizer:
    """BPE trained until each of ``words`` (default ``task_words()``) is one piece; every printable
    ASCII char is in the alphabet."""
    trainer_tokenizer = Tokenizer(BPE(unk_token=UNK))
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never")
    alphabet = sorted(set(string.printable.strip()) | {SPACE})
    trainer = BpeTrainer(
        vocab_size=4096, min_frequency=1, special_tokens=[UNK, BOS, EOS], initial_alphabet=alphabet,
        show_progress=False,
    )
    trainer_tokenizer.train_from_iterator(task_words() if words is None else words, trainer=trainer)
    return trainer_tokenizer


def llama_vocab(trained: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Llama's id layout: specials 0..2, byte tokens 3..258, then learned pieces in training order."""
    vocab = {UNK: 0, BOS: 1, EOS: 2}
    for byte in range(NUM_BYTE_TOKENS):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(trained.get_vocab().items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(merge) for merge in json.loads(trained.to_str())["model"]["merges"]]
    return vocab, merges


def build_tokenizer() -> Tokenizer:
    """The task tokenizer as a ``tokenizers.Tokenizer`` (``<image>`` and ``<pad>`` are the last ids)."""
    return llama_tokenizer(*llama_vocab(_train_merges()))


def llama_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """A ``LlamaTokenizerFast``-style tokenizer over ``vocab`` and ``merges`` (``llama_vocab``'s):
    BPE with byte fallback, Metaspace "first" without splitting, BOS prepended; ``<image>`` and
    ``<pad>`` added after the vocabulary."""
    tokenizer = _metaspace_bpe(vocab, merges)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token in (UNK, BOS, EOS, IMAGE_TOKEN, PAD)]
    )
    return tokenizer


def _metaspace_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """BPE with byte fallback, Metaspace "first" without splitting, Llama's decoder; no specials."""
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def _added_tokens_decoder(tokenizer: Tokenizer, tokens: tuple[str, ...]) -> dict:
    return {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for token in tokens
    }


def _tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = _added_tokens_decoder(tokenizer, (UNK, BOS, EOS, IMAGE_TOKEN, PAD))
    return {
        "tokenizer_class": "LlamaTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "left",
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(folder: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer), indent=2))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


QWEN_PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
QWEN_SPECIAL_TOKENS = (QWEN_PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD)
QWEN_IMAGE_PART = VISION_START + IMAGE_PAD + VISION_END

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('Only system, user and assistant roles are supported.') }}{% endif %}"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def qwen_task_words() -> list[str]:
    """The Qwen template's words: "user", "assistant", and every task word with and without its
    leading space (a turn's first text part and an answer follow a newline)."""
    words = ["user", "assistant"]
    for word in task_words():
        if word in ("USER:", " ASSISTANT:"):
            continue
        words.append(word)
        if word.startswith(" ") and len(word) > 2:
            words.append(word[1:])
    return words


def build_qwen_tokenizer() -> Tokenizer:
    """The Qwen2-VL task model's tokenizer: ``llama_vocab`` over ``qwen_task_words``, no BOS, and
    ``QWEN_SPECIAL_TOKENS`` added after the vocabulary (``<|image_pad|>`` and ``<|endoftext|>``
    included)."""
    vocab, merges = llama_vocab(_train_merges(qwen_task_words()))
    tokenizer = _metaspace_bpe(vocab, merges)
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in (UNK, *QWEN_SPECIAL_TOKENS)])
    return tokenizer


def write_qwen_tokenizer_files(folder: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json, tokenizer_config.json (Qwen's special tokens, the chat template, no BOS),
    special_tokens_map.json and chat_template.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": IM_END,
        "unk_token": UNK,
        "pad_token": QWEN_PAD,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "padding_side": "left",
        "added_tokens_decoder": _added_tokens_decoder(tokenizer, (UNK, *QWEN_SPECIAL_TOKENS)),
        "chat_template": QWEN_CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"eos_token": IM_END, "unk_token": UNK, "pad_token": QWEN_PAD}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE}, indent=2))
