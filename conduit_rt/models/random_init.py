"""Models with random weights, built directly on their device without a file.

For benchmarks that need a model of a real shape (in bf16, LLaVA-1.5-7B: 13.5 GB, Qwen3-VL-8B:
17.5 GB, InternVL3-8B: 15.9 GB, Qwen2.5-VL-7B: 16.6 GB) that no file on disk holds: the modules
are built on the meta device, as each architecture's ``load`` builds them, and each parameter is
then drawn once on the target device in the target dtype and assigned
(``load_state_dict(assign=True)``), as ``load`` does with a file's tensors, so no weight exists
twice. ``finish_loading`` then does what it does after a
load (RoPE tables, stacked projections; Qwen3-VL's q/k head permutation of the drawn rows).

``random_model(text, vision, ...)`` picks the architecture from ``text.architecture`` ("llama":
LLaVA-1.5, "qwen3vl": Qwen3-VL, "qwen2vl": Qwen2-VL / Qwen2.5-VL, "qwen2": InternVL3);
``random_llava`` is the LLaVA case.

Initialisation: matrices, embeddings, biases and layer scales ~ N(0, std^2); norm weights
~ 1 + N(0, 0.1^2) (so that a swapped or skipped norm changes outputs); never zeros. Parameters are
drawn in ``named_parameters`` order from one generator seeded with ``seed``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from conduit_rt.gguf_names import LLAMA_ARCH, QWEN2_ARCH, QWEN2VL_ARCH, QWEN3VL_ARCH
from conduit_rt.model_config import InternVLVisionConfig, QwenVisionConfig, TextModelConfig, VisionModelConfig

from . import internvl, llava, qwen2vl, qwen3vl
from .arena_model import ArenaVisionLanguageModel, check_dtype

VisionConfig = VisionModelConfig | QwenVisionConfig | InternVLVisionConfig


def _meta_llava(text: TextModelConfig, vision: VisionModelConfig | None) -> llava.LlavaModel:
    assets = llava.model_assets(text, vision, None)
    with torch.device("meta"):
        return llava.LlavaModel(llava.model_config(text, vision), assets, text, vision, attention_bias=False)


def _meta_qwen3vl(text: TextModelConfig, vision: QwenVisionConfig | None) -> qwen3vl.Qwen3VLModel:
    if vision is not None and not (isinstance(vision, QwenVisionConfig) and vision.is_qwen3):
        raise ValueError(f"a Qwen3-VL decoder needs a Qwen3-VL vision config, got {type(vision).__name__}")
    assets = qwen3vl.model_assets(text, vision, None)
    with torch.device("meta"):
        return qwen3vl.Qwen3VLModel(qwen3vl.model_config(text, vision), assets, vision)


def _meta_qwen2vl(text: TextModelConfig, vision: QwenVisionConfig | None) -> qwen2vl.Qwen2VLModel:
    if vision is not None and (not isinstance(vision, QwenVisionConfig) or vision.is_qwen3):
        kind = getattr(vision, "projector_type", type(vision).__name__)
        raise ValueError(f"a Qwen2-VL decoder needs a Qwen2-VL or Qwen2.5-VL vision config, got {kind!r}")
    assets = qwen2vl.model_assets(text, vision, None)
    with torch.device("meta"):
        return qwen2vl.Qwen2VLModel(qwen2vl.model_config(text, vision), assets, vision)


def _meta_internvl(text: TextModelConfig, vision: InternVLVisionConfig | None) -> internvl.InternVLModel:
    if vision is not None and not isinstance(vision, InternVLVisionConfig):
        raise ValueError(f"an InternVL decoder needs an InternVL vision config, got {type(vision).__name__}")
    assets = internvl.model_assets(text, vision, None)
    with torch.device("meta"):
        return internvl.InternVLModel(internvl.model_config(text, vision), assets, vision)


# text architecture -> the model's assets and its modules on the meta device, unfilled
_BUILDERS: dict[str, Callable[[TextModelConfig, VisionConfig | None], ArenaVisionLanguageModel]] = {
    LLAMA_ARCH: _meta_llava,
    QWEN3VL_ARCH: _meta_qwen3vl,
    QWEN2VL_ARCH: _meta_qwen2vl,
    QWEN2_ARCH: _meta_internvl,
}


def meta_model(text: TextModelConfig, vision: VisionConfig | None) -> ArenaVisionLanguageModel:
    """The model of these configs on the meta device, every parameter unfilled (what ``load`` fills)."""
    builder = _BUILDERS.get(text.architecture)
    if builder is None:
        raise ValueError(f"no random-weight model for text architecture {text.architecture!r}; "
                         f"supported: {', '.join(sorted(_BUILDERS))}")
    if vision is not None and not vision.source_id:
        raise ValueError("vision.source_id must name the random vision weights (it keys the image caches)")
    return builder(text, vision)


def random_model(
    text: TextModelConfig,
    vision: VisionConfig | None,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float = 0.02,
) -> ArenaVisionLanguageModel:
    """A model of these configs with random weights on ``device`` in ``dtype``, ready to run.

    ``vision.source_id`` must be set: it is the vision weights' identity in every image cache key
    (a loaded model takes it from the file).
    """
    check_dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = meta_model(text, vision)
    fill(model, device, dtype, seed, std)
    model.finish_loading(device, dtype)
    return model


def random_llava(
    text: TextModelConfig,
    vision: VisionModelConfig | None,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float = 0.02,
) -> llava.LlavaModel:
    """A LLaVA-1.5 of these configs with random weights on ``device`` in ``dtype`` (``random_model``)."""
    if text.architecture != LLAMA_ARCH:
        raise ValueError(f"random_llava needs a llama text config, got {text.architecture!r}")
    return random_model(text, vision, device, dtype, seed, std)


def fill(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int, std: float) -> None:
    """Draws every (meta) parameter of ``model`` once on ``device`` and assigns it."""
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {
        name: _draw(name, tuple(param.shape), dtype, device, generator, std)
        for name, param in model.named_parameters()
    }
    model.load_state_dict(state, strict=True, assign=True)


def _draw(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          generator: torch.Generator, std: float) -> torch.Tensor:
    """One parameter: N(1, 0.1^2) for norm weights, N(0, std^2) for everything else."""
    out = torch.empty(shape, dtype=dtype, device=device)
    module, kind = name.rsplit(".", 2)[-2:]
    if kind == "weight" and "norm" in module and len(shape) == 1:  # RMSNorm, LayerNorm
        return out.normal_(1.0, 0.1, generator=generator)
    return out.normal_(0.0, std, generator=generator)
