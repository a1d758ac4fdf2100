"""The model architectures the task model can be trained as, behind one interface.

Training, evaluation and shipping differ between architectures only in a few places: the tokenizer
and chat frame, the fresh model, the image inputs the model takes, and the folder it is saved as.
``TaskArchitecture`` holds those; everything else in the task (pools, batches, hints, the training
loop) is shared.

- ``llava``: LLaVA-1.5 (CLIP ViT at a fixed 64x64 input, so only the dense ``lookup`` pages), the
  second model of the benchmark (1-D RoPE);
- ``qwen2vl``: Qwen2-VL (dynamic resolution: every page size, M-RoPE), the headline model, since
  changed positions under M-RoPE are CONDUIT's main setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .data import LLAVA_FRAME, ChatFrame
from .evaluate import llava_image_inputs


@dataclass(frozen=True)
class TaskArchitecture:
    """What training and shipping need of one architecture.

    ``image_inputs(model, input_ids [B, T], pixels uint8 [n, S, S, 3], dtype, generate)`` -> the
    model's image keyword arguments for a forward (``generate`` False; with the batch's positions
    as ``position_ids`` when the model needs them) or for ``generate``;
    ``new_model(tokenizer, size_name, seed)`` -> a float32 model on the CPU;
    ``write_folder(model, tokenizer, folder)`` -> the Hugging Face folder (bfloat16 weights);
    ``load(folder, dtype)`` -> the model read back from it.
    """

    name: str
    families: tuple[str, ...]  # the families whose pages its image input takes
    trained_families: tuple[str, ...]  # what the training command trains by default (the shipped model's)
    sizes: tuple[str, ...]
    frame: ChatFrame
    build_tokenizer: Callable[[], Tokenizer]
    new_model: Callable[[Tokenizer, str, int], torch.nn.Module]
    image_inputs: Callable[..., dict[str, torch.Tensor]]
    write_folder: Callable[[torch.nn.Module, Tokenizer, Path], Path]
    load: Callable[[Path, torch.dtype], torch.nn.Module]


def _llava() -> TaskArchitecture:
    from .model_config import MODEL_SIZES, new_model, write_model_folder
    from .tokenizer import build_tokenizer

    def load(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype)

    return TaskArchitecture(
        name="llava", families=("lookup",), trained_families=("lookup",), sizes=tuple(MODEL_SIZES), frame=LLAVA_FRAME,
        build_tokenizer=build_tokenizer,
        new_model=lambda tokenizer, size, seed: new_model(tokenizer, MODEL_SIZES[size], seed),
        image_inputs=llava_image_inputs, write_folder=write_model_folder, load=load,
    )


def _qwen2vl() -> TaskArchitecture:
    from .data import QWEN_FRAME
    from .families import FAMILIES
    from .model_config import MODEL_SIZES
    from .qwen_model import (batch_vision_attention, image_token_types, mrope_position_ids, new_qwen_model, patchify,
                             write_qwen_model_folder)
    from .tokenizer import build_qwen_tokenizer

    def new_model(tokenizer: Tokenizer, size: str, seed: int) -> torch.nn.Module:
        model = new_qwen_model(tokenizer, MODEL_SIZES[size], seed)
        batch_vision_attention(model)
        return model

    def image_inputs(model, input_ids: torch.Tensor, pixels: torch.Tensor, dtype: torch.dtype,
                     generate: bool = False) -> dict[str, torch.Tensor]:
        pixel_values, grid = patchify(pixels)
        inputs = {"pixel_values": pixel_values.to(dtype), "image_grid_thw": grid}
        if generate:
            inputs["mm_token_type_ids"] = image_token_types(model, input_ids)
        else:
            inputs["position_ids"] = mrope_position_ids(model, input_ids, grid)
        return inputs

    def load(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=dtype)

    return TaskArchitecture(
        # where and describe are not learned within the training budget yet (docs/quality/findings.md)
        name="qwen2vl", families=tuple(FAMILIES), trained_families=("lookup", "fields"), sizes=tuple(MODEL_SIZES),
        frame=QWEN_FRAME,
        build_tokenizer=build_qwen_tokenizer, new_model=new_model, image_inputs=image_inputs,
        write_folder=write_qwen_model_folder, load=load,
    )


ARCHITECTURES: dict[str, Callable[[], TaskArchitecture]] = {"llava": _llava, "qwen2vl": _qwen2vl}


def architecture(name: str) -> TaskArchitecture:
    """The architecture called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {tuple(ARCHITECTURES)}, not {name!r}")
    return ARCHITECTURES[name]()
