"""The architectures ``conduit convert`` understands, by the ``architectures`` entry of config.json.

Adding one (Qwen2-VL, Qwen2.5-VL, ...) is a new module exposing ``HF_ARCHITECTURE``,
``DESCRIPTION`` and ``convert(source, outdir, dtype, *, progress) -> ConvertedFiles`` (see
``llava``), plus one line in ``ARCHITECTURES``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..errors import UnsupportedArchitectureError
from . import internvl, llava, qwen2vl, qwen3vl
from .gguf_output import ConvertedFiles, OutputDtype
from .source import SourceCheckpoint


class ArchitectureConverter(Protocol):
    """What an architecture module provides (modules satisfy this structurally)."""

    HF_ARCHITECTURE: str  # e.g. "LlavaForConditionalGeneration"
    DESCRIPTION: str  # one line for help texts and error messages

    def convert(self, source: SourceCheckpoint, outdir: Path, dtype: OutputDtype, *, progress: bool = True) -> ConvertedFiles:
        ...


ARCHITECTURES: dict[str, ArchitectureConverter] = {
    llava.HF_ARCHITECTURE: llava,
    **dict.fromkeys(qwen2vl.HF_ARCHITECTURES, qwen2vl),  # one module converts both Qwen generations
    internvl.HF_ARCHITECTURE: internvl,
    qwen3vl.HF_ARCHITECTURE: qwen3vl,
}


def supported_architectures() -> str:
    """One line per supported architecture: ``Name: description``."""
    return "\n".join(f"  {name}: {module.DESCRIPTION}" for name, module in ARCHITECTURES.items())


def find_converter(source: SourceCheckpoint) -> ArchitectureConverter:
    """The converter for ``source``'s config.json ``architectures``; refuses anything else, listing what is supported."""
    declared = source.config.get("architectures") or []
    for name in declared:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    what = ", ".join(declared) if declared else f"model_type {source.config.get('model_type')!r} (no 'architectures')"
    raise UnsupportedArchitectureError(
        f"{source.name}: {what} cannot be converted. Supported architectures:\n{supported_architectures()}"
    )
