"""The families section: the end-to-end reuse and prefill rows on a Qwen3-VL-8B-shaped and an
InternVL3-8B-shaped model with random weights (``family_models``), beside the LLaVA ones (``e2e``).

For each shape of ``FamilySizes.shapes``, one at a time: the model is built on the device
(``workload.build_family``), a Runtime runs over it, and ``e2e.EndToEnd`` measures

  reuse                 cold TTFT (vision tower + prefill, refresh None and "conduit"), warm TTFT of
                        ``second`` (the same images in another order under another prefix) with
                        refresh "conduit" at ``refresh`` and with a full prefill, both instrumented
                        (``breakdown.PhaseClock``) too
  transformers_prefill  the family's transformers twin (``twins``: ``Qwen3VLTextModel`` with our
                        M-RoPE positions and DeepStack features; ``Qwen2ForCausalLM``) on the same
                        decoder inputs and tensors, and the last-token logits' relative error

Rows, keyed by family (the same at every size): ``{family}.ttft.vs_full_prefill`` and
``{family}.prefill.vs_transformers`` (``e2e.ttft_row``, ``e2e.transformers_row``). The Runtime is
closed and the model, its twin and the caches are released before the next shape is built, so one
GPU holds one ~17 GB model at a time (the end-to-end section closes its own before this one).
"""
from __future__ import annotations

import gc
import logging

import torch

from . import e2e, family_models, workload
from .config import FamilySizes
from .stages import run_stages
from .targets import Target
from .timing import Timer

logger = logging.getLogger(__name__)

TWIN_NAMES = {"qwen3vl": "transformers Qwen3VLTextModel (SDPA)",
              "internvl3": "transformers Qwen2ForCausalLM (SDPA)"}


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
                  ("transformers_prefill", lambda: runs.transformers_prefill(shape.twin(runs.model)))]
        found, errors = run_stages(section, stages, before_next=runs.runtime.planner.prefix_cache.clear)
        raw.update(found)
        return raw, dict(runs.memory), errors
    finally:
        runs.runtime.close()


def _release() -> None:
    """Frees what nothing refers to any more (a Runtime's model and caches form reference cycles)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shape_rows(raw: dict) -> list[Target]:
    """The target rows of one shape's runs (none without its reuse runs)."""
    if "reuse" not in raw:
        return []
    name, family = raw["model"]["shape"], raw["model"]["family"]
    rows = [e2e.ttft_row(f"{family}.ttft.vs_full_prefill", raw["reuse"], name)]
    if "transformers_prefill" in raw:
        rows.append(e2e.transformers_row(f"{family}.prefill.vs_transformers", raw["reuse"],
                                         raw["transformers_prefill"], name, TWIN_NAMES[family]))
    return rows
