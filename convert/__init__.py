"""Hugging Face checkpoint -> GGUF conversion (text model + mmproj), llama.cpp conventions.

``convert_checkpoint(src, outdir, dtype=...)`` from Python; ``python -m convert`` or
``conduit convert`` from a shell (``convert.cli.main``).
"""
from convert.checkpoint import convert_checkpoint
from convert.gguf_output import ConvertedFiles, OutputDtype

__all__ = ["ConvertedFiles", "OutputDtype", "convert_checkpoint"]
