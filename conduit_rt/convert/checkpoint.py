"""Convert one checkpoint: open the source, pick its architecture's converter, write both GGUF files."""
from __future__ import annotations

import logging
from pathlib import Path

from .gguf_output import ConvertedFiles, OutputDtype
from .registry import find_converter
from .source import open_source

logger = logging.getLogger(__name__)


def convert_checkpoint(
    src: str | Path, outdir: str | Path, *, dtype: OutputDtype | str = OutputDtype.F16,
    revision: str | None = None, progress: bool = True,
) -> ConvertedFiles:
    """Convert ``src`` (a local Hugging Face folder or a hub repo id) into ``outdir/model.gguf`` + ``outdir/mmproj.gguf``.

    Raises ``UnsupportedArchitectureError`` (listing the supported ones) or ``ModelFormatError``
    (naming the file or tensor at fault) before writing anything when the checkpoint cannot be
    converted; ``FileNotFoundError`` when ``src`` is neither a folder nor a repo id.
    """
    source = open_source(src, revision=revision)
    converter = find_converter(source)
    logger.info("converting %s (%s) to %s, dtype %s", source.name, converter.HF_ARCHITECTURE, outdir, OutputDtype(dtype).value)
    return converter.convert(source, Path(outdir), OutputDtype(dtype), progress=progress)
