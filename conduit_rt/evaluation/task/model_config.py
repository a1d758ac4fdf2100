"""The task model's architecture (LLaVA-1.5: CLIP ViT, 2-layer MLP projector, Llama decoder) and its folder.

``ModelSize`` presets: ``default`` (about 15M parameters, about 30 MB in bfloat16) is the one
trained on a GPU and shipped; ``small`` (about 2.4M) is for CPU experiments at
reduced page counts; ``tiny`` is for CPU tests. ``write_model_folder`` writes what a
llava-hf hub repo holds (config.json, model.safetensors, tokenizer files, preprocessor_config.json,
processor_config.json, chat_template.json), so that ``LlavaForConditionalGeneration`` and
``AutoProcessor`` load it with ``from_pretrained`` and ``conduit convert`` converts it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .generator import CELL_SIZE, IMAGE_SIZE
from .tokenizer import BOS, CHAT_TEMPLATE, EOS, IMAGE_TOKEN, PAD, write_tokenizer_files

PATCH_SIZE = CELL_SIZE  # one glyph cell = one vision patch = one image token
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Widths and depths. The vision tower has ``vision_layers`` blocks; LLaVA-1.5 reads the
    penultimate one (``vision_feature_layer`` -2), so ``vision_layers - 1`` blocks do the work."""

    vision_hidden: int
    vision_layers: int
    vision_heads: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    max_positions: int = 1024


MODEL_SIZES = {
    "default": ModelSize(
        vision_hidden=256, vision_layers=5, vision_heads=4,
        text_hidden=384, text_layers=6, text_heads=6, text_kv_heads=2, text_intermediate=1024,
    ),
    "small": ModelSize(
        vision_hidden=128, vision_layers=3, vision_heads=2,
        text_hidden=192, text_layers=4, text_heads=3, text_kv_heads=1, text_intermediate=512,
    ),
    "tiny": ModelSize(
        vision_hidden=32, vision_layers=3, vision_heads=2,
        text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=128,
    ),
}


def llava_config(tokenizer: Tokenizer, size: ModelSize):
    """The ``transformers.LlavaConfig`` of the task model, token ids taken from ``tokenizer``."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=size.vision_hidden, intermediate_size=4 * size.vision_hidden,
        num_hidden_layers=size.vision_layers, num_attention_heads=size.vision_heads,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=size.vision_hidden,
        layer_norm_eps=1e-5, hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=size.text_hidden,
        intermediate_size=size.text_intermediate, num_hidden_layers=size.text_layers,
        num_attention_heads=size.text_heads, num_key_value_heads=size.text_kv_heads,
        max_position_embeddings=size.max_positions, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD), tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tokenizer.token_to_id(IMAGE_TOKEN),
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        image_seq_length=NUM_IMAGE_TOKENS, tie_word_embeddings=False,
    )


def new_model(tokenizer: Tokenizer, size: ModelSize, seed: int = 0):
    """A freshly initialised ``LlavaForConditionalGeneration`` (float32, on the CPU)."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    config = llava_config(tokenizer, size)
    config._attn_implementation = "sdpa"
    return LlavaForConditionalGeneration(config)


def write_processor_files(folder: Path) -> None:
    """preprocessor_config.json (CLIPImageProcessor), processor_config.json, chat_template.json."""
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
        "do_resize": True, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
        "resample": 3, "rescale_factor": 1 / 255,
    }
    processor = {
        "processor_class": "LlavaProcessor", "image_token": IMAGE_TOKEN, "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
    }
    folder = Path(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))


def write_model_folder(model, tokenizer: Tokenizer, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save ``model`` (cast to ``dtype`` on the way, the live model is untouched) as a HF folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to("cpu", dtype).save_pretrained(folder)
    write_tokenizer_files(folder, tokenizer)
    write_processor_files(folder)
    return folder


def count_parameters(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())
