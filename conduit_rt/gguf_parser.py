"""A strict GGUF parser: every count, length, type and offset checked against the file before use.

``parse_gguf(path)`` memory-maps the file and reads the header, the metadata keys and the tensor
table with ``struct``; nothing is allocated from a count or a length the file states until that
count or length has been checked against the bytes the file actually has. A file that breaks the
format (a bad magic or version, an unknown value or tensor type, a string or an array that runs
past the end of the file, a duplicate key or tensor name, a misaligned, overlapping or
out-of-bounds tensor, a shape whose size overflows) raises ``ModelFormatError`` naming the file
and the field: ``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``, ``key NAME`` or
``tensor NAME`` (``key #N`` / ``tensor #N`` while the name itself is being read). The format is llama.cpp's ``gguf.cpp`` (versions 2 and 3, little-endian).

Values come out as Python values (``int``, ``float``, ``bool``, ``str``), arrays of strings as
``list[str]`` and arrays of numbers as a read-only numpy array; tensor data as read-only numpy
views of the mapped file (``tensor_bytes``), valid as long as the ``GGUFContents`` lives.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from conduit_rt.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_DIM = 2**63 - 1  # ggml stores dimensions as int64
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key count
# the fewest bytes one key (8-byte length, 4-byte type, 1-byte value) and one tensor entry
# (8-byte name length, 4-byte dimension count, 4-byte type, 8-byte offset) can take
_MIN_KEY_BYTES, _MIN_TENSOR_BYTES = 13, 24

# little-endian struct format of each scalar value type
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_SCALAR_STRUCTS = {kind: struct.Struct(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFField:
    """One metadata key: ``types`` is ``(kind,)`` for a scalar or a string, ``(ARRAY, item kind)`` for an array."""

    types: tuple[GGUFValueType, ...]
    value: Any  # int | float | bool | str | list[str] | np.ndarray (read-only, little-endian)


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor table entry. ``dims`` are GGUF's order (innermost first); ``shape`` is reversed (HF order)."""

    name: str
    dims: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    n_elements: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclass(frozen=True, slots=True)
class GGUFContents:
    """A parsed, checked GGUF file: keys in file order, tensors in file order, and the mapped bytes."""

    path: Path
    version: int
    fields: dict[str, GGUFField]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_offset: int
    _buffer: mmap.mmap

    def tensor_bytes(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw bytes, a read-only uint8 view [n_bytes] of the mapped file."""
        return np.frombuffer(self._buffer, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.offset)


def parse_gguf(path: str | Path) -> GGUFContents:
    """Parse and check the whole of ``path``. Raises ``FileNotFoundError`` for a missing file, else
    ``ModelFormatError``."""
    return _open(Path(path)).parse()


def read_string_keys(path: str | Path, wanted: tuple[str, ...]) -> dict[str, str]:
    """The string values of the ``wanted`` keys that ``path`` has, reading keys only until all are
    found (a cheap look at ``general.architecture`` before the full parse). Errors as ``parse_gguf``."""
    parser = _open(Path(path))
    n_keys = parser.header()[2]
    found: dict[str, str] = {}
    for index in range(n_keys):
        key, field = parser.key_value(index)
        if key in wanted and field.types == (GGUFValueType.STRING,):
            found[key] = field.value
            if len(found) == len(wanted):
                break
    return found


def _open(path: Path) -> _Parser:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file (convert a checkpoint with `conduit convert`)")
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        if size < _HEADER.size:
            raise ModelFormatError(f"{path}: not a GGUF file ({size} bytes, shorter than the {_HEADER.size}-byte header)")
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return _Parser(path, buffer)


class _Parser:
    """Walks the mapped bytes once, front to back; ``offset`` is the next byte to read."""

    def __init__(self, path: Path, buffer: mmap.mmap) -> None:
        self.path, self.buffer, self.size, self.offset = path, buffer, len(buffer), 0

    def fail(self, field: str, problem: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {field}: {problem} (GGUF file of {self.size} bytes; reconvert it)")

    def header(self) -> tuple[int, int, int]:
        """(version, tensor count, key count), checked; leaves ``offset`` at the first key."""
        magic, version, n_tensors, n_keys = _HEADER.unpack_from(self.buffer, 0)
        self.offset = _HEADER.size
        if magic != GGUF_MAGIC:
            raise ModelFormatError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        if version not in SUPPORTED_VERSIONS:
            big_endian = version & 0xFFFF == 0 and version >> 16 != 0
            raise self.fail("GGUF.version", "a big-endian GGUF file is not supported" if big_endian
                            else f"version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
        self._check_count("GGUF.kv_count", n_keys, _MIN_KEY_BYTES)
        return version, n_tensors, n_keys

    def key_value(self, index: int) -> tuple[str, GGUFField]:
        """The ``index``-th key and its value."""
        key = self._string(f"key #{index}", "the key's name")
        return key, self._field(f"key {key}")

    def parse(self) -> GGUFContents:
        version, n_tensors, n_keys = self.header()
        fields: dict[str, GGUFField] = {}
        for index in range(n_keys):
            key, field = self.key_value(index)
            if key in fields:
                raise self.fail(f"key {key}", "the key appears twice")
            fields[key] = field
        alignment = self._alignment(fields)
        self._check_count("GGUF.tensor_count", n_tensors, _MIN_TENSOR_BYTES)
        entries = [self._tensor_entry(index) for index in range(n_tensors)]
        data_offset = -(-self.offset // alignment) * alignment
        if entries and data_offset > self.size:
            raise self.fail("GGUF.tensor_count", "the file ends before its tensor data starts (truncated)")
        tensors = tuple(self._place(entry, data_offset, alignment) for entry in entries)
        self._check_no_overlap(tensors)
        return GGUFContents(self.path, version, fields, tensors, alignment, data_offset, self.buffer)

    def _check_count(self, field: str, count: int, min_bytes: int) -> None:
        """A count is refused before the loop it drives when the rest of the file cannot hold that many."""
        if count > (self.size - self.offset) // min_bytes:
            raise self.fail(field, f"{count} entries cannot fit in the {self.size - self.offset} bytes left")

    def _read(self, field: str, what: str, unpacker: struct.Struct) -> Any:
        if self.offset + unpacker.size > self.size:
            raise self.fail(field, f"the file ends inside {what} at byte {self.offset} (truncated)")
        (value,) = unpacker.unpack_from(self.buffer, self.offset)
        self.offset += unpacker.size
        return value

    def _string(self, field: str, what: str = "a string") -> str:
        length = self._read(field, f"the length of {what}", _U64)
        if length > self.size - self.offset:
            raise self.fail(field, f"{what} of {length} bytes at byte {self.offset} runs past the end of the file")
        raw = self.buffer[self.offset : self.offset + length]
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(field, f"{what} is not valid UTF-8 ({error.reason} at byte {error.start})") from None

    def _strings(self, field: str, count: int) -> list[str]:
        """``count`` consecutive strings. Vocabularies hold 10^5 of them, so the loop has no test of
        its own: a length prefix past the end of the file makes the next ``unpack_from`` raise, and
        the last string's end is checked after the loop."""
        buffer, offset, raw = self.buffer, self.offset, []
        unpack = _U64.unpack_from
        try:
            for _ in range(count):
                (length,) = unpack(buffer, offset)
                start, offset = offset + 8, offset + 8 + length
                raw.append(buffer[start:offset])
        except (struct.error, OverflowError):
            raise self.fail(field, f"item {len(raw)} starts past the end of the file (truncated, or a length "
                                   "before it is too large)") from None
        if offset > self.size:
            raise self.fail(field, f"item {count - 1} of {length} bytes runs past the end of the file")
        self.offset = offset
        try:
            return [item.decode("utf-8") for item in raw]
        except UnicodeDecodeError as error:
            raise self.fail(field, f"an item is not valid UTF-8 ({error.reason})") from None

    def _value_type(self, field: str, what: str) -> GGUFValueType:
        raw = self._read(field, what, _U32)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(field, f"unknown value type {raw}") from None

    def _field(self, field: str) -> GGUFField:
        kind = self._value_type(field, "the value type")
        if kind == GGUFValueType.STRING:
            return GGUFField((kind,), self._string(field))
        if kind != GGUFValueType.ARRAY:
            return GGUFField((kind,), self._read(field, "the value", _SCALAR_STRUCTS[kind]))
        item_kind = self._value_type(field, "the array's item type")
        count = self._read(field, "the array length", _U64)
        if item_kind == GGUFValueType.ARRAY:
            raise self.fail(field, "arrays of arrays are not supported")
        if item_kind == GGUFValueType.STRING:
            self._check_count(field, count, _U64.size)
            return GGUFField((kind, item_kind), self._strings(field, count))
        item = _SCALAR_STRUCTS[item_kind]
        self._check_count(field, count, item.size)
        values = np.frombuffer(self.buffer, dtype=np.dtype(_SCALAR_FORMATS[item_kind]), count=count, offset=self.offset)
        self.offset += count * item.size
        return GGUFField((kind, item_kind), values)

    def _alignment(self, fields: dict[str, GGUFField]) -> int:
        field = fields.get(ALIGNMENT_KEY)
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.types != (GGUFValueType.UINT32,):
            raise self.fail(f"key {ALIGNMENT_KEY}", f"must be a UINT32, found {field.types[0].name}")
        if field.value == 0 or field.value & (field.value - 1):
            raise self.fail(f"key {ALIGNMENT_KEY}", f"{field.value} is not a power of two")
        return field.value

    def _tensor_entry(self, index: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        """(name, dims, type, offset relative to the data section) of the ``index``-th tensor table entry."""
        name = self._string(f"tensor #{index}", "the tensor's name")
        field = f"tensor {name}"
        n_dims = self._read(field, "the dimension count", _U32)
        if n_dims > MAX_DIMS:
            raise self.fail(field, f"{n_dims} dimensions (at most {MAX_DIMS})")
        dims = tuple(self._read(field, "the dimensions", _U64) for _ in range(n_dims))
        if any(dim > _MAX_DIM for dim in dims):
            raise self.fail(field, f"dimensions {list(dims)} do not fit in int64")
        raw_type = self._read(field, "the tensor type", _U32)
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.fail(field, f"unknown tensor type {raw_type}") from None
        return name, dims, tensor_type, self._read(field, "the data offset", _U64)

    def _place(self, entry: tuple[str, tuple[int, ...], GGMLQuantizationType, int], data_offset: int,
               alignment: int) -> GGUFTensorInfo:
        """The entry's bytes, checked: whole quantization blocks, aligned, inside the file."""
        name, dims, tensor_type, relative = entry
        field = f"tensor {name}"
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if dims and dims[0] % block_size:
            raise self.fail(field, f"row length {dims[0]} is not a multiple of {tensor_type.name}'s block of {block_size}")
        n_elements = int(np.prod(dims, dtype=object)) if dims else 1
        n_bytes = n_elements // block_size * type_size
        if relative % alignment:
            raise self.fail(field, f"data offset {relative} is not a multiple of the alignment {alignment}")
        start = data_offset + relative
        if n_bytes > self.size or start + n_bytes > self.size:
            raise self.fail(field, f"{n_bytes} bytes of {tensor_type.name} data at byte {start} run past the end "
                                   "of the file (truncated)")
        return GGUFTensorInfo(name, dims, tensor_type, start, n_elements, n_bytes)

    def _check_no_overlap(self, tensors: tuple[GGUFTensorInfo, ...]) -> None:
        names: set[str] = set()
        for tensor in tensors:
            if tensor.name in names:
                raise self.fail(f"tensor {tensor.name}", "the tensor name appears twice")
            names.add(tensor.name)
        placed = sorted((t for t in tensors if t.n_bytes), key=lambda t: t.offset)
        for before, after in zip(placed, placed[1:]):
            if after.offset < before.offset + before.n_bytes:
                raise self.fail(f"tensor {after.name}", f"its data overlaps tensor {before.name}'s")
