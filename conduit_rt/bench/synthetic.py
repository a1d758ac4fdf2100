"""What the end-to-end benchmarks run on, made on the spot: model configs, a word-level tokenizer,
random images, chat requests of exact token counts, and a transformers twin of the decoder.

- ``llava_configs("llava-1.5-7b")``: Llama-2-7B (32 layers, hidden 4096, 32 heads, no GQA, vocab
  32064) under CLIP ViT-L/14-336 (23 of its 24 blocks, as LLaVA's feature layer -2 uses; 576 tokens
  per image) and the 2-layer GELU projector; ``"tiny"`` is a 2-layer model for the CPU smoke run.
- The tokenizer maps each whitespace-separated word to one id (``w123`` is id 123), so a request's
  text has exactly the token count asked for; it fills the whole vocabulary, so every id the
  random LM head can produce decodes. ``WordVocabulary`` lays one out (special tokens and template
  words, fillers, image tokens); ``llava_vocabulary`` is LLaVA's, ``family_models`` makes Qwen's and
  InternVL's. Requests draw their words from its ``fillers``.
- ``transformers_twin(model)``: a ``LlamaForCausalLM`` (SDPA attention) whose parameters ARE the
  model's decoder tensors (shared, not copied): both sides run the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

from ..evaluation.task.tokenizer import CHAT_TEMPLATE  # LLaVA-1.5's conversation format
from ..extras import require
from ..model_config import TextModelConfig, VisionModelConfig

# what a missing transformers says (bench/cli.py checks it before the run starts)
TWIN = {"extra": "bench", "command": "conduit bench", "purpose": "for its end-to-end comparison",
        "otherwise": "leave those sections out with --skip e2e --skip families"}

SPECIALS = ("<unk>", "<s>", "</s>")
IMAGE_TOKEN, PAD_TOKEN = "<image>", "<pad>"
# pieces the chat template writes, and one-character pieces the streaming detokenizer looks for
TEMPLATE_WORDS = ("USER", "ASSISTANT", ":", "a", "x", "e", "0", "A", "!", ".")


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of a LLaVA-1.5: the Llama decoder, the CLIP tower and its input."""

    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    image_size: int
    patch_size: int


SHAPES = {
    "llava-1.5-7b": Shape(vocab=32064, hidden=4096, intermediate=11008, n_layers=32, n_heads=32, n_kv_heads=32,
                          vision_hidden=1024, vision_intermediate=4096, vision_layers=23, vision_heads=16,
                          image_size=336, patch_size=14),
    "tiny": Shape(vocab=512, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2,
                  vision_hidden=32, vision_intermediate=64, vision_layers=2, vision_heads=4,
                  image_size=30, patch_size=6),
}


@dataclass(frozen=True, slots=True)
class WordVocabulary:
    """A word-level vocabulary of ``size`` ids: the ``leading`` pieces (special tokens, the chat
    template's words), the fillers ``w{id}`` (``fillers``), then the ``trailing`` pieces. ``special``
    lists the pieces that are special tokens (matched before splitting on whitespace, skipped when
    decoding); ``unk`` is the piece an unknown word would map to (none occurs: every word is in it)."""

    size: int
    leading: tuple[str, ...]
    trailing: tuple[str, ...]
    special: tuple[str, ...]
    unk: str

    @property
    def fillers(self) -> range:
        """Ids of the filler words, which requests draw their text from."""
        return range(len(self.leading), self.size - len(self.trailing))

    def pieces(self) -> tuple[str, ...]:
        """The piece of every id, in id order."""
        return (*self.leading, *(f"w{i}" for i in self.fillers), *self.trailing)

    def tokenizer(self) -> Tokenizer:
        pieces = self.pieces()
        tokenizer = Tokenizer(WordLevel({piece: i for i, piece in enumerate(pieces)}, unk_token=self.unk))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.decoder = decoders.Fuse()  # pieces glued: random output needs no spacing
        tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in self.special])
        return tokenizer


def llava_vocabulary(vocab_size: int) -> WordVocabulary:
    """``<unk> <s> </s>``, the template words, ``w{id}`` fillers, then ``<image> <pad>``."""
    return WordVocabulary(vocab_size, SPECIALS + TEMPLATE_WORDS, (IMAGE_TOKEN, PAD_TOKEN),
                          (*SPECIALS, IMAGE_TOKEN, PAD_TOKEN), "<unk>")


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """LLaVA's word-level tokenizer (``llava_vocabulary``)."""
    return llava_vocabulary(vocab_size).tokenizer()


def llava_configs(name: str, max_positions: int = 65536, seed: int = 0) -> tuple[TextModelConfig, VisionModelConfig]:
    """The text and vision configs of a named shape (``SHAPES``), with the word tokenizer embedded."""
    s = SHAPES[name]
    tokenizer = word_tokenizer(s.vocab)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = tuple(piece for piece, _ in sorted(vocab.items(), key=lambda item: item[1]))
    text = TextModelConfig(
        architecture="llama", vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads,
        head_dim=s.hidden // s.n_heads, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling_type=None,
        rope_scaling_factor=1.0, max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab[PAD_TOKEN],
        unk_token_id=vocab["<unk>"], image_token_id=vocab[IMAGE_TOKEN], add_bos_token=True, add_eos_token=False,
        tokens=tokens, chat_template=CHAT_TEMPLATE, tokenizer_json=tokenizer.to_str(), source_id=f"bench:{name}",
    )
    vision = VisionModelConfig(
        projector_type="mlp", image_size=s.image_size, patch_size=s.patch_size, num_channels=3,
        hidden_size=s.vision_hidden, intermediate_size=s.vision_intermediate, num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads, layer_norm_eps=1e-5, hidden_act="quick_gelu",
        projector_hidden_act="gelu", projection_dim=s.hidden, feature_layer=-2, feature_select_strategy="default",
        image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711),
        preprocessor_config={}, processor_config={}, source_id=f"bench:{name}:vision:seed{seed}",
    )
    return text, vision


def random_images(n: int, side: int, seed: int) -> list[Image.Image]:
    """``n`` distinct RGB noise images of ``side`` x ``side`` pixels."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(n)]


def words(n: int, fillers: range, rng: np.random.Generator) -> str:
    """``n`` random filler words (one token each) of the ids ``fillers`` (``WordVocabulary.fillers``)."""
    return " ".join(f"w{i}" for i in rng.integers(fillers.start, fillers.stop, n))


def image_request(images: list, prefix_words: int, question_words: int, fillers: range, seed: int,
                  document_words: int = 0) -> list[dict]:
    """System text (``prefix_words`` + ``document_words``), then one user turn: the images, a question."""
    rng = np.random.default_rng(seed)
    content = [{"type": "image", "image": image} for image in images]
    content.append({"type": "text", "text": words(question_words, fillers, rng)})
    system = words(prefix_words + document_words, fillers, rng)
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def text_request(n_words: int, fillers: range, seed: int) -> list[dict]:
    return [{"role": "user", "content": words(n_words, fillers, np.random.default_rng(seed))}]


def transformers_twin(model):
    """``LlamaForCausalLM`` (SDPA) sharing ``model``'s decoder parameters, on its device."""
    require("transformers", **TWIN)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = model.config
    config = LlamaConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope.theta, max_position_embeddings=65536,
        tie_word_embeddings=False, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        twin = LlamaForCausalLM(config)
    params = {name if name.startswith("lm_head") else f"model.{name}": p
              for name, p in model.language_model.named_parameters()}
    twin.load_state_dict(params, strict=True, assign=True)
    twin.model.rotary_emb = LlamaRotaryEmbedding(config).to(model.device)  # built off meta: real inv_freq
    twin.generation_config.eos_token_id = None  # random weights: always generate the asked length
    twin.generation_config.pad_token_id = c.bos_token_id
    return twin.eval().requires_grad_(False)

