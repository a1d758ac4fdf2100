"""The other families' end-to-end models, made on the spot as ``synthetic`` makes LLaVA's: configs of
a named shape (``SHAPES``) with a word-level tokenizer and the family's chat template, built with
random weights on the device by ``models.random_init.random_model``, and their transformers twins.

- ``qwen3-vl-8b``: Qwen3-VL-8B-Instruct. Text: Qwen3 decoder, hidden 4096, intermediate 12288, 36
  layers, 32 heads over 8 KV heads of head_dim 128, vocab 151936, RoPE theta 5e6 with interleaved
  M-RoPE sections (24, 20, 20), q/k RMSNorm, untied LM head, DeepStack into the first 3 layers.
  Vision: 27 blocks, hidden 1152, intermediate 4304, 16 heads, 16-px patches of 2 frames merged
  2x2, 2304 learned positions (a 48 x 48 grid), DeepStack after blocks 8, 16 and 24, output 4096;
  preprocessing as its ``preprocessor_config.json`` (mean = std = 0.5, 65536..16777216 pixels).
  The benchmark's images are 1024 x 1024: 64 x 64 patches, 1024 tokens each.
- ``internvl3-8b``: InternVL3-8B. Text: Qwen2.5-7B (hidden 3584, intermediate 18944, 28 layers, 28
  heads over 4 KV heads of head_dim 128, vocab 151674, theta 1e6, q/k/v biases, untied); vision:
  InternViT-300M-448px (24 layers, hidden 1024, intermediate 4096, 16 heads, 14-px patches of
  448-px tiles, LayerNorm, layer scales), pixel shuffle by 2 and the MLP projector: 256 tokens a
  tile. The benchmark's images are 448 x 448: one tile (the grid closest to a square image that it
  covers more than half of is 1 x 1), no thumbnail, 256 tokens each.
- ``qwen2.5-vl-7b``: Qwen2.5-VL-7B-Instruct. Text: Qwen2.5-7B (hidden 3584, intermediate 18944, 28
  layers, 28 heads over 4 KV heads of head_dim 128, vocab 152064, theta 1e6, q/k/v biases, untied)
  with contiguous M-RoPE sections (16, 24, 24). Vision: 32 blocks, hidden 1280, intermediate 3420
  (gated SiLU MLP), 16 heads, RMSNorm, 14-px patches of 2 frames merged 2x2 into 3584, attention
  inside 112-px windows except blocks 7, 15, 23 and 31; preprocessing as its
  ``preprocessor_config.json`` (CLIP mean and std, 3136..12845056 pixels). The benchmark's images
  are 896 x 896: 64 x 64 patches, 1024 tokens each, 8 x 8 windows of 4 x 4 tokens.
- ``qwen3-vl-tiny``, ``qwen2.5-vl-tiny`` and ``internvl3-tiny``: the same structures a few layers
  deep, 64-px images (16 tokens each; Qwen2.5-VL's in 4 windows of 4), for the CPU smoke run.

Tokenizers (``synthetic.WordVocabulary``): Qwen's ``<|endoftext|>`` (BOS and pad, never written),
``<|im_start|>``, ``<|im_end|>`` (EOS) and the turn words first, the fillers, then the image tokens:
Qwen3-VL's and Qwen2.5-VL's ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` (their
template writes the three around each image; the runtime repeats ``<|image_pad|>`` once per visual
token), InternVL's ``<img>``, ``</img>``, ``<IMG_CONTEXT>`` (its template writes ``<IMG_CONTEXT>``;
the runtime repeats it once per visual token between ``<img>`` and ``</img>``,
``ModelAssets.image_wrap``). The templates are the families' turn format without a default system
prompt (every benchmark request has a system message of its own).
"""
from __future__ import annotations

from dataclasses import dataclass

from conduit_rt.evaluation.task.tokenizer import (
    IM_END,
    IM_START,
    IMAGE_PAD,
    QWEN_CHAT_TEMPLATE,
    QWEN_PAD,
    VISION_END,
    VISION_START,
)
from conduit_rt.gguf_names import (
    PROJECTOR_INTERNVL,
    PROJECTOR_QWEN3VL,
    PROJECTOR_QWEN25VL,
    QWEN2_ARCH,
    QWEN2VL_ARCH,
    QWEN3VL_ARCH,
)
from conduit_rt.model_config import InternVLVisionConfig, QwenVisionConfig, TextModelConfig
from conduit_rt.models.internvl import IMAGE_END, IMAGE_START
from conduit_rt.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from conduit_rt.preprocess_tiles import IMAGENET_MEAN, IMAGENET_STD

from . import twins
from .synthetic import WordVocabulary

# one-character pieces the streaming detokenizer looks for (``tokenizer._SENTINEL_CANDIDATES``)
SENTINELS = ("a", "x", "e", "0", "A", "!", ".")
TURN_WORDS = ("system", "user", "assistant")
QWEN_LEADING = (QWEN_PAD, IM_START, IM_END, *TURN_WORDS, *SENTINELS)
INTERNVL_CONTEXT = "<IMG_CONTEXT>"
# InternVL3's turn format (Qwen's), an image part written as "<IMG_CONTEXT>\n"
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The decoder's sizes, as its config.json gives them."""

    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    max_positions: int


@dataclass(frozen=True, slots=True)
class TowerShape:
    """The vision tower's sizes; ``image_side``: the square images the benchmark shows."""

    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    patch_size: int
    image_side: int


@dataclass(frozen=True, slots=True)
class Qwen3VLShape:
    """A Qwen3-VL: its decoder and tower, the M-RoPE sections, DeepStack, the learned position grid
    and the preprocessor's pixel bounds."""

    text: DecoderShape
    vision: TowerShape
    rope_sections: tuple[int, int, int]
    deepstack_indexes: tuple[int, ...]
    num_position_embeddings: int
    min_pixels: int
    max_pixels: int
    merge_size: int = 2
    family: str = "qwen3vl"  # the target rows' key prefix
    title: str = "Qwen3-VL"

    def vocabulary(self) -> WordVocabulary:
        return WordVocabulary(self.text.vocab, QWEN_LEADING, (VISION_START, VISION_END, IMAGE_PAD),
                              (QWEN_PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD), QWEN_PAD)

    def configs(self, name: str, seed: int = 0) -> tuple[TextModelConfig, QwenVisionConfig]:
        """The text and vision configs, the word tokenizer and Qwen's template embedded."""
        words = self.vocabulary()
        text = _text_config(self.text, words, QWEN3VL_ARCH, QWEN_CHAT_TEMPLATE, IMAGE_PAD, name,
                            rope_sections=self.rope_sections,
                            num_deepstack_layers=len(self.deepstack_indexes))
        v = self.vision
        preprocessor = {"size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                        "patch_size": v.patch_size, "temporal_patch_size": 2, "merge_size": self.merge_size,
                        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
        vision = QwenVisionConfig(
            projector_type=PROJECTOR_QWEN3VL, patch_size=v.patch_size, temporal_patch_size=2,
            spatial_merge_size=self.merge_size, num_channels=3, hidden_size=v.hidden, intermediate_size=v.intermediate,
            num_hidden_layers=v.n_layers, num_attention_heads=v.n_heads, layer_norm_eps=1e-6,
            hidden_act="gelu_pytorch_tanh", projection_dim=self.text.hidden, window_size=0, fullatt_block_indexes=(),
            rope_theta=10000.0, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
            preprocessor_config=preprocessor, processor_config={}, source_id=f"bench:{name}:vision:seed{seed}",
            num_position_embeddings=self.num_position_embeddings, deepstack_visual_indexes=self.deepstack_indexes,
        )
        return text, vision

    def twin(self, model) -> twins.Prefill:
        return twins.qwen3vl_twin(model).prefill

    def vision_twin(self, model) -> twins.Encode:
        return twins.qwen3vl_vision_twin(model)


@dataclass(frozen=True, slots=True)
class Qwen25VLShape:
    """A Qwen2.5-VL: its Qwen2 decoder with M-RoPE and its windowed tower, the M-RoPE sections, the
    window side in pixels, the full-attention blocks and the preprocessor's pixel bounds."""

    text: DecoderShape
    vision: TowerShape
    rope_sections: tuple[int, int, int]
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    min_pixels: int
    max_pixels: int
    merge_size: int = 2
    family: str = "qwen25vl"
    title: str = "Qwen2.5-VL"

    def vocabulary(self) -> WordVocabulary:
        return WordVocabulary(self.text.vocab, QWEN_LEADING, (VISION_START, VISION_END, IMAGE_PAD),
                              (QWEN_PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD), QWEN_PAD)

    def configs(self, name: str, seed: int = 0) -> tuple[TextModelConfig, QwenVisionConfig]:
        """The text and vision configs, the word tokenizer and Qwen's template embedded."""
        words = self.vocabulary()
        text = _text_config(self.text, words, QWEN2VL_ARCH, QWEN_CHAT_TEMPLATE, IMAGE_PAD, name,
                            rope_sections=self.rope_sections)
        v = self.vision
        preprocessor = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "patch_size": v.patch_size,
                        "temporal_patch_size": 2, "merge_size": self.merge_size,
                        "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD)}
        vision = QwenVisionConfig(
            projector_type=PROJECTOR_QWEN25VL, patch_size=v.patch_size, temporal_patch_size=2,
            spatial_merge_size=self.merge_size, num_channels=3, hidden_size=v.hidden, intermediate_size=v.intermediate,
            num_hidden_layers=v.n_layers, num_attention_heads=v.n_heads, layer_norm_eps=1e-6, hidden_act="silu",
            projection_dim=self.text.hidden, window_size=self.window_size,
            fullatt_block_indexes=self.fullatt_block_indexes, rope_theta=10000.0, image_mean=OPENAI_CLIP_MEAN,
            image_std=OPENAI_CLIP_STD, preprocessor_config=preprocessor, processor_config={},
            source_id=f"bench:{name}:vision:seed{seed}",
        )
        return text, vision

    def twin(self, model) -> twins.Prefill:
        return twins.qwen25vl_twin(model).prefill

    def vision_twin(self, model) -> twins.Encode:
        return twins.qwen25vl_vision_twin(model)


@dataclass(frozen=True, slots=True)
class InternVLShape:
    """An InternVL3: its Qwen2 decoder, InternViT over ``tile``-px tiles, the pixel shuffle's factor
    and the most tiles an image may be cut into."""

    text: DecoderShape
    vision: TowerShape
    tile: int
    scale_factor: int = 2
    max_tiles: int = 12
    family: str = "internvl3"
    title: str = "InternVL3"

    def vocabulary(self) -> WordVocabulary:
        return WordVocabulary(self.text.vocab, QWEN_LEADING, (IMAGE_START, IMAGE_END, INTERNVL_CONTEXT),
                              (QWEN_PAD, IM_START, IM_END, IMAGE_START, IMAGE_END, INTERNVL_CONTEXT), QWEN_PAD)

    def configs(self, name: str, seed: int = 0) -> tuple[TextModelConfig, InternVLVisionConfig]:
        """The text and vision configs, the word tokenizer and InternVL's template embedded."""
        words = self.vocabulary()
        text = _text_config(self.text, words, QWEN2_ARCH, INTERNVL_CHAT_TEMPLATE, INTERNVL_CONTEXT, name)
        v = self.vision
        vision = InternVLVisionConfig(
            projector_type=PROJECTOR_INTERNVL, image_size=self.tile, patch_size=v.patch_size, num_channels=3,
            hidden_size=v.hidden, intermediate_size=v.intermediate, num_hidden_layers=v.n_layers,
            num_attention_heads=v.n_heads, layer_norm_eps=1e-6, hidden_act="gelu", projector_hidden_act="gelu",
            projection_dim=self.text.hidden, scale_factor=self.scale_factor, image_mean=IMAGENET_MEAN,
            image_std=IMAGENET_STD, preprocessor_config={}, processor_config={},
            source_id=f"bench:{name}:vision:seed{seed}", min_tiles=1, max_tiles=self.max_tiles,
        )
        return text, vision

    def twin(self, model) -> twins.Prefill:
        return twins.causal_lm_prefill(twins.qwen2_twin(model))

    def vision_twin(self, model) -> twins.Encode:
        return twins.internvl_vision_twin(model)


def _text_config(s: DecoderShape, words: WordVocabulary, architecture: str, template: str, image_token: str,
                 name: str, rope_sections: tuple[int, ...] = (), num_deepstack_layers: int = 0) -> TextModelConfig:
    """A Qwen decoder's config (RMSNorm eps 1e-6; the architecture implies the q/k/v biases or q/k
    norms) with a Qwen tokenizer: ``<|endoftext|>`` is BOS (never written) and pad, ``<|im_end|>`` EOS."""
    pieces = words.pieces()
    ids = {piece: i for i, piece in enumerate(pieces)}
    return TextModelConfig(
        architecture=architecture, vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads,
        head_dim=s.head_dim, rms_norm_eps=1e-6, rope_theta=s.rope_theta, rope_scaling_type=None,
        rope_scaling_factor=1.0, max_position_embeddings=s.max_positions, tie_word_embeddings=False,
        bos_token_id=ids[QWEN_PAD], eos_token_id=ids[IM_END], pad_token_id=ids[QWEN_PAD], unk_token_id=None,
        image_token_id=ids[image_token], add_bos_token=False, add_eos_token=False, tokens=pieces,
        chat_template=template, tokenizer_json=words.tokenizer().to_str(), source_id=f"bench:{name}",
        rope_sections=rope_sections, num_deepstack_layers=num_deepstack_layers,
    )


QWEN3VL_8B = Qwen3VLShape(
    text=DecoderShape(vocab=151936, hidden=4096, intermediate=12288, n_layers=36, n_heads=32, n_kv_heads=8,
                      head_dim=128, rope_theta=5e6, max_positions=262144),
    vision=TowerShape(hidden=1152, intermediate=4304, n_layers=27, n_heads=16, patch_size=16, image_side=1024),
    rope_sections=(24, 20, 20), deepstack_indexes=(8, 16, 24), num_position_embeddings=2304,
    min_pixels=65536, max_pixels=16777216,
)
INTERNVL3_8B = InternVLShape(
    text=DecoderShape(vocab=151674, hidden=3584, intermediate=18944, n_layers=28, n_heads=28, n_kv_heads=4,
                      head_dim=128, rope_theta=1e6, max_positions=32768),
    vision=TowerShape(hidden=1024, intermediate=4096, n_layers=24, n_heads=16, patch_size=14, image_side=448),
    tile=448,
)
QWEN25VL_7B = Qwen25VLShape(
    text=DecoderShape(vocab=152064, hidden=3584, intermediate=18944, n_layers=28, n_heads=28, n_kv_heads=4,
                      head_dim=128, rope_theta=1e6, max_positions=128000),
    vision=TowerShape(hidden=1280, intermediate=3420, n_layers=32, n_heads=16, patch_size=14, image_side=896),
    rope_sections=(16, 24, 24), window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
    min_pixels=3136, max_pixels=12845056,
)
FamilyShape = Qwen3VLShape | Qwen25VLShape | InternVLShape
SHAPES: dict[str, FamilyShape] = {
    "qwen3-vl-8b": QWEN3VL_8B,
    "internvl3-8b": INTERNVL3_8B,
    "qwen2.5-vl-7b": QWEN25VL_7B,
    # 64-px images of 8-px patches merged 2x2: 16 tokens; 4 x 4 learned positions
    "qwen3-vl-tiny": Qwen3VLShape(
        text=DecoderShape(vocab=512, hidden=64, intermediate=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                          rope_theta=5e6, max_positions=4096),
        vision=TowerShape(hidden=32, intermediate=64, n_layers=2, n_heads=4, patch_size=8, image_side=64),
        rope_sections=(4, 2, 2), deepstack_indexes=(0, 1), num_position_embeddings=16,
        min_pixels=16 * 16, max_pixels=64 * 64,
    ),
    # 64-px images of 8-px patches merged 2x2: 16 tokens in 4 windows of 32 px (2 x 2 tokens); the
    # first block attends within windows, the second across the image
    "qwen2.5-vl-tiny": Qwen25VLShape(
        text=DecoderShape(vocab=512, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                          rope_theta=1e6, max_positions=4096),
        vision=TowerShape(hidden=32, intermediate=48, n_layers=2, n_heads=4, patch_size=8, image_side=64),
        rope_sections=(2, 3, 3), window_size=32, fullatt_block_indexes=(1,), min_pixels=16 * 16,
        max_pixels=64 * 64,
    ),
    # one 64-px tile of 8-px patches: 16 tokens after the pixel shuffle
    "internvl3-tiny": InternVLShape(
        text=DecoderShape(vocab=512, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                          rope_theta=1e6, max_positions=4096),
        vision=TowerShape(hidden=32, intermediate=64, n_layers=2, n_heads=4, patch_size=8, image_side=64),
        tile=64,
    ),
}
