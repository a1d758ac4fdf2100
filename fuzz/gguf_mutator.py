"""A structure-aware mutator for GGUF files: edits keys, value types, counts, shapes, offsets.

``mutate(data, max_size, seed)`` parses ``data`` leniently into a header, a key list, a tensor
table and a data section (``GGUFModel``), applies one to three edits of the kinds a corrupt or
hostile file has, and writes the file back with everything else consistent: the edit is the only
thing wrong with it. Raw byte flips land mostly in the tensor data of a real file, where they test
little; these edits land on every field the loader reads. An input the lenient parse cannot read
(already broken past repair) gets libFuzzer's byte-level mutation instead.
"""
from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field

GGUF_MAGIC = b"GGUF"
STRING, ARRAY, UINT32 = 8, 9, 4
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
TENSOR_TYPES = (0, 1, 2, 8, 30, 39, 4, 1000, 2**32 - 1)  # F32, F16, Q4_0, Q8_0, BF16, a late one, unknown ones
BOUNDARY_INTS = (0, 1, 2, 3, 7, 16, 64, 255, 2**15, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1)
BOUNDARY_FLOATS = (0.0, -0.0, 1e-30, -1.0, 1e30, float("nan"), float("inf"), float("-inf"))
STRINGS = (
    "", "llama", "qwen2vl", "clip", "mmproj", "model", "mlp", "qwen2vl_merger", "qwen2.5vl_merger", "gelu", "silu",
    "none", "linear", "{}", "[]", "[" * 5000, "{\"size\": 7}", "{\"size\": {\"shortest_edge\": 1000000000}}",
    "{\"image_mean\": [1, 2], \"crop_size\": \"x\"}", "{{ raise_exception('x') }}", "{% for %}", "\xff" * 3,
    "{% for a in b %}" * 40, "{\"model\": {\"type\": \"BPE\"}}",
)


@dataclass
class KeyValue:
    key: bytes
    kind: int
    payload: bytes  # the encoded value after the 4-byte type


@dataclass
class TensorEntry:
    name: bytes
    dims: list[int]
    kind: int
    offset: int


@dataclass
class GGUFModel:
    version: int
    keys: list[KeyValue] = field(default_factory=list)
    tensors: list[TensorEntry] = field(default_factory=list)
    data: bytes = b""
    alignment: int = 32

    def to_bytes(self, n_tensors: int | None = None, n_keys: int | None = None) -> bytes:
        n_tensors = len(self.tensors) if n_tensors is None else n_tensors
        n_keys = len(self.keys) if n_keys is None else n_keys
        parts = [struct.pack("<4sIQQ", GGUF_MAGIC, self.version % 2**32, n_tensors % 2**64, n_keys % 2**64)]
        for kv in self.keys:
            parts += [_string(kv.key), struct.pack("<I", kv.kind), kv.payload]
        for tensor in self.tensors:
            parts += [_string(tensor.name), struct.pack("<I", len(tensor.dims))]
            parts += [struct.pack("<Q", dim % 2**64) for dim in tensor.dims]
            parts += [struct.pack("<IQ", tensor.kind % 2**32, tensor.offset % 2**64)]
        head = b"".join(parts)
        # an edited alignment may be huge: pad only to a sane one (the file is then misaligned)
        padding = -len(head) % self.alignment if 0 < self.alignment <= 4096 else 0
        return head + b"\0" * padding + self.data


def _string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.offset + size > len(self.data):
            raise ValueError("past the end")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def unpack(self, fmt: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.take(self.unpack("<Q"))

    def value(self, kind: int) -> None:
        if kind == STRING:
            self.string()
        elif kind == ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in SCALAR_SIZES:
                self.take(SCALAR_SIZES[item] * count)
            elif item == STRING and count <= len(self.data):
                for _ in range(count):
                    self.string()
            else:
                raise ValueError("unreadable array")
        elif kind in SCALAR_SIZES:
            self.take(SCALAR_SIZES[kind])
        else:
            raise ValueError("unknown type")


def parse(data: bytes) -> GGUFModel:
    """The file's structure, or ``ValueError`` when it is too broken to read."""
    reader = _Reader(data)
    magic, version, n_tensors, n_keys = struct.unpack("<4sIQQ", reader.take(24))
    if magic != GGUF_MAGIC or n_keys > len(data) or n_tensors > len(data):
        raise ValueError("not a readable GGUF")
    model = GGUFModel(version)
    for _ in range(n_keys):
        key, kind = reader.string(), reader.unpack("<I")
        start = reader.offset
        reader.value(kind)
        model.keys.append(KeyValue(key, kind, data[start : reader.offset]))
        if key == b"general.alignment" and kind == UINT32:
            model.alignment = struct.unpack("<I", model.keys[-1].payload)[0]
    for _ in range(n_tensors):
        name, n_dims = reader.string(), reader.unpack("<I")
        if n_dims > 8:
            raise ValueError("too many dims")
        dims = [reader.unpack("<Q") for _ in range(n_dims)]
        model.tensors.append(TensorEntry(name, dims, reader.unpack("<I"), reader.unpack("<Q")))
    if model.alignment <= 0 or model.alignment & (model.alignment - 1):
        raise ValueError("bad alignment")
    model.data = data[-(-reader.offset // model.alignment) * model.alignment :]
    return model


def _scalar(kind: int, rng: random.Random) -> bytes:
    if kind in (6, 12):
        return struct.pack(SCALAR_FORMATS[kind], rng.choice(BOUNDARY_FLOATS + (rng.uniform(-10, 1e5),)))
    fmt = SCALAR_FORMATS[kind]
    bits = SCALAR_SIZES[kind] * 8
    value = rng.choice(BOUNDARY_INTS + (rng.randrange(0, 600),)) % 2**bits
    if fmt[1].islower() and value >= 2 ** (bits - 1):
        value -= 2**bits
    return struct.pack(fmt, value)


def _new_value(rng: random.Random) -> tuple[int, bytes]:
    """A value of a random type: scalar, string, array of scalars or strings, or a broken one."""
    roll = rng.randrange(6)
    if roll == 0:
        kind = rng.choice(list(SCALAR_SIZES))
        return kind, _scalar(kind, rng)
    if roll == 1:
        return STRING, _string(rng.choice(STRINGS).encode("utf-8", "surrogateescape"))
    if roll == 2:
        item = rng.choice(list(SCALAR_SIZES))
        count = rng.randrange(5)
        return ARRAY, struct.pack("<IQ", item, count) + b"".join(_scalar(item, rng) for _ in range(count))
    if roll == 3:
        count = rng.randrange(4)
        return ARRAY, struct.pack("<IQ", STRING, count) + b"".join(_string(rng.choice(STRINGS).encode()) for _ in range(count))
    if roll == 4:  # an array of arrays, or of an unknown type
        return ARRAY, struct.pack("<IQ", rng.choice((ARRAY, 13, 2**31)), 1) + struct.pack("<IQ", 0, 0)
    return rng.choice((13, 99, 2**32 - 1)), b""


def _edit_value(kv: KeyValue, rng: random.Random) -> None:
    """Keep the key, change its value within its type (or its declared lengths)."""
    if kv.kind in SCALAR_SIZES:
        kv.payload = _scalar(kv.kind, rng)
    elif kv.kind == STRING:
        text = kv.payload[8:]
        choice = rng.randrange(4)
        if choice == 0 and text:  # JSON documents and templates: edit inside them
            cut = rng.randrange(len(text))
            text = text[:cut] + rng.choice(STRINGS).encode() + text[cut + rng.randrange(8):]
        elif choice == 1:
            text = _edit_json(text, rng)
        else:
            text = rng.choice(STRINGS).encode("utf-8", "surrogateescape")
        kv.payload = _string(text)
        if choice == 3:  # the length prefix lies
            kv.payload = struct.pack("<Q", rng.choice(BOUNDARY_INTS)) + text
    elif kv.kind == ARRAY and len(kv.payload) >= 12:
        item, count = struct.unpack("<IQ", kv.payload[:12])
        body = kv.payload[12:]
        choice = rng.randrange(4)
        if choice == 0:
            count = rng.choice(BOUNDARY_INTS)  # the count lies
        elif choice == 1 and item in SCALAR_SIZES and body:
            size = SCALAR_SIZES[item]
            index = rng.randrange(len(body) // size)
            body = body[: index * size] + _scalar(item, rng) + body[(index + 1) * size :]
        elif choice == 2:
            item = rng.choice(list(SCALAR_SIZES) + [STRING, ARRAY, 77])
        else:
            count, body = (count // 2, body[: len(body) // 2]) if item in SCALAR_SIZES else (count, body)
        kv.payload = struct.pack("<IQ", item % 2**32, count) + body


def _edit_json(text: bytes, rng: random.Random) -> bytes:
    """A JSON object with one value replaced by something of another type or size."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if not isinstance(document, dict) or not document:
        return text
    key = rng.choice(sorted(document))
    document[key] = rng.choice((None, -1, 0, 10**12, 1.5, "x", [], {}, [0.5], {"height": 10**9, "width": 1},
                                {"shortest_edge": rng.choice((1, 29, 31, 10**7))}, [1, 2, 3, 4], float("nan")))
    return json.dumps(document).encode()


def _edit_key(model: GGUFModel, rng: random.Random) -> None:
    if not model.keys:
        model.keys.append(KeyValue(b"general.architecture", *_new_value(rng)))
        return
    index = rng.randrange(len(model.keys))
    kv = model.keys[index]
    choice = rng.randrange(10)
    if choice < 5:
        _edit_value(kv, rng)
    elif choice == 5:
        kv.kind, kv.payload = _new_value(rng)
    elif choice == 6:
        model.keys.append(KeyValue(kv.key, kv.kind, kv.payload))  # duplicate key
    elif choice == 7:
        del model.keys[index]
    elif choice == 8:  # another key's value under this key's name
        other = rng.choice(model.keys)
        kv.kind, kv.payload = other.kind, other.payload
    else:
        kv.key = rng.choice((b"", b"\xff\xfe", kv.key + b"x", rng.choice(model.keys).key))


def _edit_tensor(model: GGUFModel, rng: random.Random) -> None:
    if not model.tensors:
        return
    index = rng.randrange(len(model.tensors))
    tensor = model.tensors[index]
    choice = rng.randrange(9)
    if choice == 0 and tensor.dims:
        tensor.dims[rng.randrange(len(tensor.dims))] = rng.choice(BOUNDARY_INTS)
    elif choice == 1:
        tensor.dims = tensor.dims[::-1] if rng.randrange(2) else tensor.dims + [rng.choice((1, 2, 2**40))]
    elif choice == 2:
        tensor.kind = rng.choice(TENSOR_TYPES)
    elif choice == 3:
        tensor.offset = rng.choice((tensor.offset + rng.choice((1, 16, 32, -32)), len(model.data), 2**63, 2**64 - 32))
    elif choice == 4:
        tensor.offset = rng.choice(model.tensors).offset  # overlaps another
    elif choice == 5:
        tensor.name = rng.choice(model.tensors).name if rng.randrange(2) else tensor.name + b".x"
    elif choice == 6:
        del model.tensors[index]
    elif choice == 7:
        model.tensors.append(TensorEntry(tensor.name + b"2", list(tensor.dims), tensor.kind, tensor.offset))
    else:
        tensor.dims = tensor.dims[:-1] if tensor.dims else [0, 0, 0, 0, 0]


def _edit_layout(model: GGUFModel, rng: random.Random) -> tuple[int | None, int | None]:
    """Header and data section: version, lying counts, alignment, truncation. Returns count overrides."""
    choice = rng.randrange(6)
    if choice == 0:
        model.version = rng.choice((0, 1, 2, 3, 4, 3 << 16, 2**32 - 1))
    elif choice == 1:
        return rng.choice((len(model.tensors) + 1, 2**32, 2**63, 2**64 - 1)), None
    elif choice == 2:
        return None, rng.choice((len(model.keys) + 1, len(model.keys) - 1, 2**40, 2**64 - 1))
    elif choice == 3:
        alignment = rng.choice((0, 1, 3, 8, 64, 48, 2**31))
        model.keys = [kv for kv in model.keys if kv.key != b"general.alignment"]
        model.keys.append(KeyValue(b"general.alignment", UINT32, struct.pack("<I", alignment)))
        model.alignment = alignment if alignment > 0 and not alignment & (alignment - 1) else 32
    elif choice == 4 and model.data:
        model.data = model.data[: rng.randrange(len(model.data))]
    elif model.data:  # corrupt tensor data: loads, with whatever values the bytes hold
        cut = rng.randrange(len(model.data))
        model.data = model.data[:cut] + bytes(rng.randrange(256) for _ in range(64)) + model.data[cut + 64 :]
    return None, None


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's custom mutator: a structured edit of ``data``, or a byte-level one when unreadable."""
    import atheris  # only here: the file format half of this module serves tests without atheris

    rng = random.Random(seed)
    try:
        model = parse(data)
    except (ValueError, struct.error):
        return atheris.Mutate(data, max_size)
    if rng.randrange(10) == 0:  # byte-level edits of the header and tables only, tensor data kept
        head = data[: len(data) - len(model.data)]
        return (atheris.Mutate(head, len(head) + 64) + model.data)[:max_size]
    counts: tuple[int | None, int | None] = (None, None)
    for _ in range(rng.choice((1, 1, 2, 3))):
        roll = rng.randrange(10)
        if roll < 5:
            _edit_key(model, rng)
        elif roll < 8:
            _edit_tensor(model, rng)
        else:
            counts = _edit_layout(model, rng)
    return model.to_bytes(*counts)[:max_size]
