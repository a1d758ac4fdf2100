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

    ``image_inputs(pixels uint8 [n, S, S, 3], dtype)`` -> the model's image keyword arguments;
    ``new_model(tokenizer, size_name, seed)`` -> a float32 model on the CPU;
    ``write_folder(model, tokenizer, folder)`` -> the Hugging Face folder (bfloat16 weights);
    ``load(folder, dtype)`` -> the model read back from it.
    """

    name: str
    families: tuple[str, ...]
    sizes: tuple[str, ...]
    frame: ChatFrame
    build_tokenizer: Callable[[], Tokenizer]
    new_model: Callable[[Tokenizer, str, int], torch.nn.Module]
    image_inputs: Callable[[torch.Tensor, torch.dtype], dict[str, torch.Tensor]]
    write_folder: Callable[[torch.nn.Module, Tokenizer, Path], Path]
    load: Callable[[Path, torch.dtype], torch.nn.Module]


def _llava() -> TaskArchitecture:
    from .model_config import MODEL_SIZES, new_model, write_model_folder
    from .tokenizer import build_tokenizer

    def load(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype)

    return TaskArchitecture(
        name="llava", families=("lookup",), sizes=tuple(MODEL_SIZES), frame=LLAVA_FRAME,
        build_tokenizer=build_tokenizer,
        new_model=lambda tokenizer, size, seed: new_model(tokenizer, MODEL_SIZES[size], seed),
        image_inputs=llava_image_inputs, write_folder=write_model_folder, load=load,
    )


ARCHITECTURES: dict[str, Callable[[], TaskArchitecture]] = {"llava": _llava}


def architecture(name: str) -> TaskArchitecture:
    """The architecture called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {tuple(ARCHITECTURES)}, not {name!r}")
    return ARCHITECTURES[name]()
