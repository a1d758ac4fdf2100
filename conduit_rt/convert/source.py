"""The checkpoint being converted: a local Hugging Face folder or a hub repo id (downloaded first).

Weights are read one tensor at a time from safetensors files (single file or sharded with an
index), so converting never holds the whole model in memory.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelFormatError

logger = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]  # what a conversion reads; never *.bin or *.pt
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_FINGERPRINT_SAMPLE = 1 << 20  # bytes hashed from the start and the end of each weight file's data


@dataclass(frozen=True)
class SourceCheckpoint:
    """A Hugging Face checkpoint folder: its config, side files and a name -> safetensors file index."""

    root: Path
    name: str  # the hub repo id or the folder name
    config: dict[str, Any]
    config_text: str  # config.json verbatim
    tensor_files: dict[str, Path]  # tensor name (as stored) -> the safetensors file holding it

    def json_file(self, filename: str) -> dict[str, Any] | None:
        """A JSON side file (tokenizer_config.json, ...) parsed, or None when absent."""
        path = self.root / filename
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{path}: not valid JSON ({exc})") from exc

    def text_file(self, filename: str) -> str | None:
        path = self.root / filename
        return path.read_text(encoding="utf-8") if path.is_file() else None

    @property
    def tensor_names(self) -> list[str]:
        return list(self.tensor_files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (from the safetensors header; no data read)."""
        with safe_open(self.tensor_files[name], framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as float32 on the CPU, shape as stored."""
        with safe_open(self.tensor_files[name], framework="pt") as handle:
            return handle.get_tensor(name).to(torch.float32)

    def fingerprint(self) -> str:
        """sha256 over config.json and a sample of every weight file's data (start and end, 1 MiB each).

        Written into both GGUF files as ``conduit.source_id`` so that the loader can tell an mmproj of
        another checkpoint apart, even one with the same config and different weights.
        """
        digest = hashlib.sha256(self.config_text.encode("utf-8"))
        for path in sorted(set(self.tensor_files.values())):
            digest.update(path.name.encode("utf-8"))
            digest.update(_data_sample(path))
        return digest.hexdigest()


def open_source(src: str | Path, *, revision: str | None = None) -> SourceCheckpoint:
    """A local folder, or a hub repo id (``owner/name``) downloaded with ``snapshot_download``."""
    path = Path(src).expanduser()
    if path.is_dir():
        return _read_folder(path, path.name)
    if path.exists():
        raise ModelFormatError(f"{src}: expected a checkpoint folder, found a file")
    if not _REPO_ID.match(str(src)):
        raise FileNotFoundError(f"{src}: no such folder, and not a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from the Hugging Face hub", src)
    try:
        local = snapshot_download(repo_id=str(src), revision=revision, allow_patterns=HUB_PATTERNS)
    except (OSError, ValueError) as exc:  # the hub's HTTP, not-found and validation errors
        raise FileNotFoundError(f"{src}: no such folder, and downloading it from the Hugging Face hub failed: {exc}") from exc
    return _read_folder(Path(local), str(src))


def _read_folder(root: Path, name: str) -> SourceCheckpoint:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{root}: no config.json; is this a Hugging Face checkpoint folder?")
    config_text = config_path.read_text(encoding="utf-8")
    try:
        config = json.loads(config_text)
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{config_path}: not valid JSON ({exc})") from exc
    return SourceCheckpoint(root=root, name=name, config=config, config_text=config_text, tensor_files=_index_tensors(root))


def _index_tensors(root: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or else every *.safetensors file."""
    index_path = root / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
        missing = sorted({file for file in weight_map.values() if not (root / file).is_file()})
        if missing:
            raise ModelFormatError(f"{index_path}: shard(s) {', '.join(missing)} missing")
        return {tensor: root / file for tensor, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in root.glob("*.bin"))) or "none"
        raise ModelFormatError(f"{root}: no *.safetensors weights (found .bin files: {found}); save the model as safetensors")
    index: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                index.update(dict.fromkeys(handle.keys(), file))
        except SafetensorError as exc:  # truncated or not a safetensors file at all
            raise ModelFormatError(f"{file}: not a readable safetensors file ({exc})") from exc
    return index


def _data_sample(path: Path) -> bytes:
    """The first and last ``_FINGERPRINT_SAMPLE`` bytes of a safetensors file's data section."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        start = 8 + header_len
        handle.seek(start)
        head = handle.read(_FINGERPRINT_SAMPLE)
        handle.seek(max(start, size - _FINGERPRINT_SAMPLE))
        tail = handle.read(_FINGERPRINT_SAMPLE)
    return size.to_bytes(8, "little") + head + tail
