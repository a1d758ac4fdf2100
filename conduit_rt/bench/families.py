"""The families section: the end-to-end reuse, prefill and vision-tower rows on Qwen3-VL-8B-,
InternVL3-8B- and Qwen2.5-VL-7B-shaped models with random weights (``family_models``), beside the
LLaVA ones (``e2e``).

For each shape of ``FamilySizes.shapes``, one at a time: the model is built on the device
(``workload.build_family``), a Runtime runs over it, and ``e2e.EndToEnd`` measures

  reuse                 cold TTFT (vision tower + prefill, refresh None and "conduit"), warm TTFT of
                        ``second`` (the same images in another order under another prefix) with
                        refresh "conduit" at ``refresh`` and with a full prefill, both instrumented
                        (``breakdown.PhaseClock``) too
  transformers_prefill  the family's transformers twin (``twins``: ``Qwen3VLTextModel`` with our
                        M-RoPE positions and DeepStack features; ``Qwen2_5_VLTextModel`` with our
                        M-RoPE positions; ``Qwen2ForCausalLM``) on the same decoder inputs and
                        tensors, and the last-token logits' relative error
  transformers_vision   the vision tower and projector of a cold request, image by image
                        (``vision_tower``): ours against the family's transformers tower
                        (``Qwen3VLVisionModel``, ``Qwen2_5_VisionTransformerPretrainedModel``,
                        ``InternVLModel``'s image features) on the same pixels and tensors, with
                        the embeddings' errors

Rows, keyed by family (the same at every size): ``{family}.ttft.vs_full_prefill``,
``{family}.prefill.vs_transformers`` (``e2e.ttft_row``, ``e2e.transformers_row``) and
``{family}.vision.vs_transformers`` (``vision_row``). The Runtime is closed and the model, its
twins and the caches are released before the next shape is built, so one GPU holds one ~17 GB
model at a time (the end-to-end section closes its own before this one).
"""
from __future__ import annotations

import gc
import logging

import torch

from conduit_rt.preprocess import to_rgb_array

from . import e2e, family_models, twins, workload
from .config import FamilySizes
from .stages import run_stages
from .targets import Target, at_least
from .timing import PeakMemory, Timer, Timing

logger = logging.getLogger(__name__)

TWIN_NAMES = {"qwen3vl": "transformers Qwen3VLTextModel (SDPA)",
              "qwen25vl": "transformers Qwen2_5_VLTextModel (SDPA)",
              "internvl3": "transformers Qwen2ForCausalLM (SDPA)"}
VISION_TWIN_NAMES = {"qwen3vl": "transformers Qwen3VLVisionModel (SDPA)",
                     "qwen25vl": "transformers Qwen2_5_VisionTransformerPretrainedModel (SDPA)",
                     "internvl3": "transformers InternVLModel image features (SDPA)"}


def run(sizes: FamilySizes, timer: Timer, dtype: torch.dtype) -> tuple[dict, list[Target], dict, dict[str, str]]:
    """Every shape's runs; returns ({shape: raw numbers}, target rows, peak memory per run as
    "shape/run", errors). A shape whose model cannot be built, or a stage that raises, is recorded
    in the errors and the rest still runs."""
    raw: dict = {}
    rows: list[Target] = []
    memory: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for name in sizes.shapes:
        _release()  # the previous model (this section's or the end-to-end section's) off the device
        found, shape_memory, shape_errors = _measure(name, sizes, timer, dtype)
        _release()
        errors.update(shape_errors)
        memory.update({f"{name}/{run_name}": peak for run_name, peak in shape_memory.items()})
        if found:
            raw[name] = found
            rows += shape_rows(found)
    return raw, rows, memory, errors


def _measure(name: str, sizes: FamilySizes, timer: Timer, dtype: torch.dtype) -> tuple[dict, dict, dict[str, str]]:
    """One shape's runs: (raw numbers, peak memory per run, errors)."""
    section = f"families.{name}"
    shape = family_models.SHAPES[name]
    try:
        runs = e2e.EndToEnd(sizes, timer, dtype, workload.build_family(name, sizes, timer.device, dtype))
    except Exception as exc:  # e.g. out of memory: the other shapes still run
        logger.exception("%s: the model could not be built", section)
        return {}, {}, {section: f"{type(exc).__name__}: {exc}"[:300]}
    try:
        raw = {"model": {"shape": name, "family": shape.family, "image_side": shape.vision.image_side,
                         "weight_bytes_per_token": e2e.weight_bytes_per_token(runs.model),
                         "kv_bytes_per_token": e2e.kv_bytes_per_token(runs.model)}}
        stages = [("reuse", runs.reuse),
                  ("transformers_prefill", lambda: runs.transformers_prefill(shape.twin(runs.model))),
                  ("transformers_vision", lambda: vision_tower(runs, shape.vision_twin(runs.model)))]
        found, errors = run_stages(section, stages, before_next=runs.runtime.planner.prefix_cache.clear)
        raw.update(found)
        return raw, dict(runs.memory), errors
    finally:
        runs.runtime.close()


def vision_tower(runs: e2e.EndToEnd, twin: twins.Encode) -> dict:
    """Our vision tower and projector against ``twin``'s on the workload's images, one image a call
    as a cold request encodes them (``request.py``), from the same pixels already on the device
    (preprocessing excluded): median times of all the images and the errors of their embeddings
    [visual tokens, embedding width] against ours."""
    inputs = _vision_inputs(runs)
    ours, timing = _encode_all(runs, twins.our_encode(runs.model), inputs, "vision")
    theirs, their_timing = _encode_all(runs, twin, inputs, "transformers_vision")
    if ours.shape != theirs.shape:
        raise ValueError(f"the twin's embeddings are {list(theirs.shape)}, ours {list(ours.shape)}")
    error = ours - theirs
    return {"images": len(inputs), "tokens": int(ours.shape[0]), "width": int(ours.shape[1]),
            "seconds": timing.median_s, "time": timing.as_dict(),
            "transformers_seconds": their_timing.median_s, "transformers_time": their_timing.as_dict(),
            "embeddings_max_abs": float(theirs.abs().max()), "max_abs_err_vs_ours": float(error.abs().max()),
            "rel_err_vs_ours": float(error.norm() / theirs.norm())}


def _vision_inputs(runs: e2e.EndToEnd) -> list[twins.VisionInputs]:
    """Each workload image preprocessed by the model, on its device in its dtype."""
    model, out = runs.model, []
    for image in runs.images:
        prepared = model.prepare_image(to_rgb_array(image))
        grids = (prepared.grid_thw,) if prepared.grid_thw is not None else ()
        out.append(twins.VisionInputs(prepared.pixel_values.to(runs.device, model.dtype), grids))
    return out


def _encode_all(runs: e2e.EndToEnd, encode: twins.Encode, inputs: list[twins.VisionInputs],
                label: str) -> tuple[torch.Tensor, Timing]:
    """``encode`` of every image, one call each: (their embeddings concatenated, float32 [tokens,
    width]; the median time of all the calls); its peak memory is recorded under ``label``."""
    calls = [encode(image) for image in inputs]

    def every_image() -> torch.Tensor:
        return torch.cat([call() for call in calls])

    with torch.no_grad(), PeakMemory(runs.device) as peak:
        timing = runs.timer.wall_time(every_image, repeat=runs.s.repeats, warmup=1)
        embeddings = every_image().float()
    runs.memory[label] = peak.as_dict()
    return embeddings, timing


def _release() -> None:
    """Frees what nothing refers to any more (a Runtime's model and caches form reference cycles)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shape_rows(raw: dict) -> list[Target]:
    """The target rows of one shape's runs (those whose stages ran)."""
    name, family = raw["model"]["shape"], raw["model"]["family"]
    rows = []
    if "reuse" in raw:
        rows.append(e2e.ttft_row(f"{family}.ttft.vs_full_prefill", raw["reuse"], name))
        if "transformers_prefill" in raw:
            rows.append(e2e.transformers_row(f"{family}.prefill.vs_transformers", raw["reuse"],
                                             raw["transformers_prefill"], name, TWIN_NAMES[family]))
    if "transformers_vision" in raw:
        rows.append(vision_row(f"{family}.vision.vs_transformers", raw["transformers_vision"], name,
                               VISION_TWIN_NAMES[family]))
    return rows


def vision_row(key: str, vision: dict, model: str, twin: str) -> Target:
    """Our vision tower + projector time against ``twin``'s (``vision_tower``), with the embeddings' errors."""
    return at_least(key, f"{model}: vision tower + projector of {vision['images']} images (cold) vs {twin}, "
                    "same weights", vision["seconds"] * 1e3, vision["transformers_seconds"] * 1e3, "ms", 1.0,
                    "transformers time / our time",
                    f"{vision['tokens']} visual tokens; embeddings max abs err {vision['max_abs_err_vs_ours']:.1e} "
                    f"(largest value {vision['embeddings_max_abs']:.1e}), rel err {vision['rel_err_vs_ours']:.1e} "
                    "vs ours", invert=True)
