"""Hugging Face checkpoint -> GGUF conversion (text model + mmproj), llama.cpp conventions.

``convert_checkpoint(src, outdir, dtype=...)`` from Python; ``python -m conduit_rt.convert`` or
``conduit convert`` from a shell (``conduit_rt.convert.cli.main``).
"""
from .checkpoint import convert_checkpoint
from .gguf_output import ConvertedFiles, OutputDtype

__all__ = ["ConvertedFiles", "OutputDtype", "convert_checkpoint"]
