"""Running a section's stages so that one failure (an unsupported backend, memory) costs only its
own numbers: each stage that raises is logged and recorded, and the next one runs."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def run_stages(section: str, stages: list[tuple[str, Callable[[], object]]],
               before_next: Callable[[], object] | None = None) -> tuple[dict, dict[str, str]]:
    """Runs ``(name, fn)`` in order; returns ({name: result} of those that ran, {section.name: error})."""
    results, errors = {}, {}
    for name, fn in stages:
        logger.info("%s: %s", section, name)
        try:
            results[name] = fn()
        except Exception as exc:  # keep the other stages' numbers
            logger.exception("%s stage %s failed", section, name)
            errors[f"{section}.{name}"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if before_next is not None:
                before_next()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return results, errors
