"""Model files from whatever a user points at: a GGUF file, a folder of GGUF files, or a Hugging Face
checkpoint folder, which is converted once into the cache (``config.env().cache_dir``/models) and
found there by the digest of its files on later runs."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from ..config import env
from ..errors import ModelFormatError
from .checkpoint import convert_checkpoint

logger = logging.getLogger(__name__)

MODEL_FILE, MMPROJ_FILE = "model.gguf", "mmproj.gguf"


def model_files(path: str | Path, mmproj: str | Path | None = None, dtype: str = "bf16") -> tuple[Path, Path | None]:
    """(text model GGUF, vision GGUF or None) for ``path``:

    - a ``.gguf`` file: itself, and ``mmproj.gguf`` beside it when ``mmproj`` is None and one is there;
    - a folder holding ``model.gguf``: that file (and its ``mmproj.gguf``);
    - a Hugging Face checkpoint folder (``config.json``): its GGUF conversion in ``dtype``, made on first use.
    Raises ModelFormatError naming what was expected when ``path`` is none of these.
    """
    path = Path(path)
    if path.is_dir():
        if (path / MODEL_FILE).is_file():
            path = path / MODEL_FILE
        elif (path / "config.json").is_file():
            path = converted_checkpoint(path, dtype)
        else:
            raise ModelFormatError(f"{path} is a folder with neither {MODEL_FILE} nor a Hugging Face config.json; "
                                   "point at a GGUF file, a folder of converted files or a checkpoint folder")
    elif not path.is_file():
        raise ModelFormatError(f"no such model file: {path}")
    if mmproj is None and (path.parent / MMPROJ_FILE).is_file() and path.name != MMPROJ_FILE:
        mmproj = path.parent / MMPROJ_FILE
    elif mmproj is not None and not Path(mmproj).is_file():
        raise ModelFormatError(f"no such mmproj file: {mmproj}")
    return path, Path(mmproj) if mmproj is not None else None


def converted_checkpoint(hf_dir: Path, dtype: str = "bf16") -> Path:
    """``model.gguf`` of a local checkpoint folder, converted on first use and cached by content."""
    digest = hashlib.sha256(dtype.encode())
    for file in sorted(p for p in hf_dir.iterdir() if p.is_file()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    out = env().cache_dir / "models" / digest.hexdigest()[:16]
    if not (out / MODEL_FILE).is_file():
        logger.warning("converting %s to GGUF (%s) in %s, once", hf_dir, dtype, out)
        # written beside, then renamed: an interrupted conversion never leaves a half-written cache entry
        staging = out.with_name(f"{out.name}.{os.getpid()}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        convert_checkpoint(hf_dir, staging, dtype=dtype, progress=False)
        try:
            staging.rename(out)
        except OSError:  # another process finished first: its files are the same
            shutil.rmtree(staging, ignore_errors=True)
    return out / MODEL_FILE
