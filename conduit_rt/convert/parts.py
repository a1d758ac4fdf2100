"""What every family's converter shares: the checkpoint's tensors split into the model's parts, the
processor settings, and config validation errors turned into ``ModelFormatError``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ModelFormatError, UnsupportedArchitectureError
from .source import SourceCheckpoint

T = TypeVar("T")


def split_parts(source: SourceCheckpoint, prefixes: dict[str, tuple[str, str]], family: str) -> dict[str, dict[str, str]]:
    """{part: {name inside the part: stored name}} by ``prefixes`` (stored-name prefix -> (part, prefix
    of the name inside that part)); the longest matching prefix wins, and a tensor that matches none
    is refused (raises ModelFormatError naming ``family``)."""
    parts: dict[str, dict[str, str]] = {part: {} for part, _ in prefixes.values()}
    ordered = sorted(prefixes, key=len, reverse=True)
    for stored in source.tensor_names:
        prefix = next((p for p in ordered if stored.startswith(p)), None)
        if prefix is None:
            raise ModelFormatError(f"{source.root}: tensor {stored} belongs to no part of a {family} model")
        part, inner = prefixes[prefix]
        parts[part][inner + stored[len(prefix):]] = stored
    return parts


def processor_settings(source: SourceCheckpoint) -> dict[str, Any]:
    """processor_config.json without the image processor part (kept separately) and the template."""
    processor = source.json_file("processor_config.json") or {}
    return {key: value for key, value in processor.items() if key not in ("image_processor", "chat_template")}


def build_config(source: SourceCheckpoint, build: Callable[[], T]) -> T:
    """``build()``, with config validation errors (``ValueError``) raised as ``ModelFormatError``
    naming the checkpoint."""
    try:
        return build()
    except (ModelFormatError, UnsupportedArchitectureError):
        raise
    except ValueError as exc:
        raise ModelFormatError(f"{source.root}/config.json: {exc}") from exc
