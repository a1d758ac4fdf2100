"""Typed reading of GGUF metadata keys: each value's presence and type checked, errors name file and key."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from conduit_rt.errors import ModelFormatError

_INT_TYPES = frozenset({
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
})
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_REQUIRED: Any = object()


class KeyReader:
    """Reads the keys of one GGUF file. A missing key returns ``default`` or, without one, raises."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def int(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._scalar(key, _INT_TYPES, "an integer", int, default)

    def float(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._scalar(key, _FLOAT_TYPES, "a float", float, default)

    def bool(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._scalar(key, frozenset({GGUFValueType.BOOL}), "a bool", bool, default)

    def str(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._scalar(key, frozenset({GGUFValueType.STRING}), "a string", str, default)

    def json(self, key: str, default: Any = _REQUIRED) -> Any:
        """A string key holding a JSON document, parsed."""
        text = self.str(key, default=None)
        if text is None:
            return self._missing(key, default)
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{self._path}: key {key} is not valid JSON ({exc})") from exc

    def str_list(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, frozenset({GGUFValueType.STRING}), "strings", str, default)

    def float_list(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, _FLOAT_TYPES, "floats", float, default)

    def int_list(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, _INT_TYPES, "integers", int, default)

    def _scalar(self, key: str, allowed: frozenset, what: str, cast: type, default: Any) -> Any:
        field = self._fields.get(key)
        if field is None:
            return self._missing(key, default)
        if len(field.types) != 1 or field.types[0] not in allowed:
            raise ModelFormatError(f"{self._path}: key {key} should be {what}, found {self._type_name(field.types)}")
        return cast(field.contents())

    def _array(self, key: str, allowed: frozenset, what: str, cast: type, default: Any) -> list:
        field = self._fields.get(key)
        if field is None:
            return self._missing(key, default)
        if len(field.types) < 2 or field.types[0] != GGUFValueType.ARRAY or field.types[-1] not in allowed:
            raise ModelFormatError(f"{self._path}: key {key} should be an array of {what}, found {self._type_name(field.types)}")
        return [cast(value) for value in field.contents()]

    def _missing(self, key: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise ModelFormatError(f"{self._path}: missing key {key}")
        return default

    @staticmethod
    def _type_name(types: list[GGUFValueType]) -> str:
        return "[" + " of ".join(t.name for t in types) + "]" if len(types) > 1 else types[0].name
