"""Writing one GGUF file: the output dtype policy, tensor encoding, streaming write with a progress bar.

Tensors are planned first (name, shape, storage type, a loader), the header and tensor table are
written from the plan, then each tensor is loaded, encoded and appended one at a time: memory
stays at about one tensor. The file appears under its final name only when complete.
"""
from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize
from tqdm import tqdm

from ..errors import ModelFormatError

logger = logging.getLogger(__name__)

GGML = GGMLQuantizationType


class OutputDtype(str, enum.Enum):
    """``--dtype``: how weight matrices are stored. 1-D tensors (norms, biases) are always F32."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"  # matrices with rows a multiple of 32; other matrices fall back to F16

    @property
    def file_type(self) -> LlamaFileType:
        """``general.file_type``, as llama.cpp sets it."""
        return {
            OutputDtype.F32: LlamaFileType.ALL_F32, OutputDtype.F16: LlamaFileType.MOSTLY_F16,
            OutputDtype.BF16: LlamaFileType.MOSTLY_BF16, OutputDtype.Q8_0: LlamaFileType.MOSTLY_Q8_0,
        }[self]


def storage_type(shape: Sequence[int], dtype: OutputDtype, *, quantizable: bool = True) -> GGMLQuantizationType:
    """The GGML type a tensor of ``shape`` is stored as under ``dtype``.

    ``quantizable=False`` keeps a matrix out of Q8_0 (used for the vision embeddings); it then
    falls back to F16, as llama.cpp does for matrices it cannot quantize.
    """
    if len(shape) < 2 or dtype is OutputDtype.F32:
        return GGML.F32
    if dtype is OutputDtype.BF16:
        return GGML.BF16
    block_size, _ = GGML_QUANT_SIZES[GGML.Q8_0]
    if dtype is OutputDtype.Q8_0 and quantizable and len(shape) == 2 and shape[-1] % block_size == 0:
        return GGML.Q8_0
    return GGML.F16


def encoded_nbytes(shape: Sequence[int], qtype: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) * type_size // block_size


def encode(data: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """float tensor -> the bytes (as a numpy array) GGUF stores for ``qtype``; same element order."""
    array = data.detach().to(torch.float32).contiguous().numpy()
    if qtype == GGML.F32:
        return array
    if qtype == GGML.F16:
        return array.astype(np.float16)
    return quantize(array, qtype)  # BF16 and Q8_0: uint8 rows, bit-exact with ggml's conversions


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor to write: GGUF name, HF-convention shape, storage type and how to produce it."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    load: Callable[[], torch.Tensor]  # returns the final float values, shape ``shape``


def named_tensors(
    source_root: Path, stored_names: dict[str, str], name_map, expected: dict[str, tuple[int, ...]],
    family: str, skip: Callable[[str], bool],
) -> dict[str, str]:
    """GGUF name -> stored name for the text tensors of ``stored_names`` (HF name -> stored name),
    through gguf's ``name_map``; names ``skip`` accepts are left out, and one with no expected GGUF
    name is refused (ModelFormatError naming the ``family``)."""
    found: dict[str, str] = {}
    for hf_name, stored in stored_names.items():
        if skip(hf_name):
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in expected:
            raise ModelFormatError(f"{source_root}: unexpected text tensor {stored} (no {family} GGUF name)")
        found[gguf_name] = stored
    return found


def plan_tensors(
    source_root: Path, found: dict[str, str], expected: dict[str, tuple[int, ...]], part: str, dtype: OutputDtype,
    shape_of: Callable[[str], tuple[int, ...]], loader: Callable[[str, str], Callable[[], torch.Tensor]],
    quantizable: Callable[[str], bool] = lambda name: True,
) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per ``expected`` GGUF name (in its order) from ``found`` (GGUF name ->
    stored name): every expected tensor must be there with its shape, else ModelFormatError naming
    the ``part`` ("text", "vision"). ``loader(stored, gguf_name)`` makes the tensor's producer."""
    planned = []
    for gguf_name, shape in expected.items():
        stored = found.get(gguf_name)
        if stored is None:
            raise ModelFormatError(f"{source_root}: missing {part} tensor for {gguf_name}")
        if shape_of(stored) != shape:
            raise ModelFormatError(f"{source_root}: tensor {stored} has shape {list(shape_of(stored))}, expected {list(shape)}")
        qtype = storage_type(shape, dtype, quantizable=quantizable(gguf_name))
        planned.append(PlannedTensor(gguf_name, shape, qtype, loader(stored, gguf_name)))
    return planned


@dataclass(frozen=True)
class ConvertedFiles:
    """What a conversion wrote."""

    text_model: Path  # DIR/model.gguf
    mmproj: Path  # DIR/mmproj.gguf


def write_gguf(
    path: Path, arch: str, add_keys: Callable[[GGUFWriter], None], tensors: Sequence[PlannedTensor],
    *, progress: bool = True,
) -> Path:
    """Write ``path``: keys from ``add_keys(writer)``, then ``tensors`` in order, streamed."""
    partial = path.with_name(path.name + ".part")
    writer = GGUFWriter(partial, arch)
    add_keys(writer)
    for planned in tensors:
        writer.add_tensor_info(
            planned.name, planned.shape, np.dtype(np.float32), encoded_nbytes(planned.shape, planned.qtype),
            raw_dtype=planned.qtype,
        )
    total = sum(encoded_nbytes(planned.shape, planned.qtype) for planned in tensors)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}", disable=not progress) as bar:
            for planned in tensors:
                data = _checked(planned, planned.load())
                writer.write_tensor_data(encode(data, planned.qtype))
                bar.update(encoded_nbytes(planned.shape, planned.qtype))
        writer.close()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    logger.info("wrote %s (%d tensors, %.1f MiB)", path, len(tensors), path.stat().st_size / 2**20)
    return path


def _checked(planned: PlannedTensor, data: torch.Tensor) -> torch.Tensor:
    if tuple(data.shape) != planned.shape:
        raise RuntimeError(f"{planned.name}: produced shape {tuple(data.shape)}, planned {planned.shape}")
    return data
