"""Models with random weights, built directly on their device without a file.

For benchmarks that need a model of a real shape (LLaVA-1.5-7B: 13.5 GB in bf16) that no file on
disk holds: the modules are built on the meta device, and each parameter is then drawn once on the
target device in the target dtype and assigned (``load_state_dict(assign=True)``), as ``llava.load``
does with a file's tensors, so no weight exists twice.

Initialisation: matrices, embeddings and biases ~ N(0, std^2); norm weights ~ 1 + N(0, 0.1^2) (so
that a swapped or skipped norm changes outputs); never zeros.
"""

from __future__ import annotations

import torch

from conduit_rt.model_config import TextModelConfig, VisionModelConfig

from .arena_model import check_dtype
from .llava import LlavaModel, model_assets, model_config


def random_llava(
    text: TextModelConfig,
    vision: VisionModelConfig | None,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float = 0.02,
) -> LlavaModel:
    """A LLaVA-1.5 of these configs with random weights on ``device`` in ``dtype``, ready to run.

    ``vision.source_id`` must be set: it is the vision weights' identity in every image cache key
    (a loaded model takes it from the file).
    """
    check_dtype(dtype)
    if vision is not None and not vision.source_id:
        raise ValueError("vision.source_id must name the random vision weights (it keys the image caches)")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    assets = model_assets(text, vision, None)
    with torch.device("meta"):
        model = LlavaModel(model_config(text, vision), assets, text, vision, attention_bias=False)
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {
        name: _draw(name, tuple(param.shape), dtype, device, generator, std)
        for name, param in model.named_parameters()
    }
    model.load_state_dict(state, strict=True, assign=True)
    model.finish_loading(device, dtype)
    return model


def _draw(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          generator: torch.Generator, std: float) -> torch.Tensor:
    """One parameter: N(1, 0.1^2) for norm weights, N(0, std^2) for everything else."""
    out = torch.empty(shape, dtype=dtype, device=device)
    module, kind = name.rsplit(".", 2)[-2:]
    if kind == "weight" and "norm" in module and len(shape) == 1:  # RMSNorm, LayerNorm
        return out.normal_(1.0, 0.1, generator=generator)
    return out.normal_(0.0, std, generator=generator)
