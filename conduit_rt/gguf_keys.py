"""Typed reading of GGUF metadata keys: each value's presence and type checked, errors name file and key."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from conduit_rt.errors import ModelFormatError
from conduit_rt.gguf_parser import GGUFField

_INT_TYPES = frozenset({
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
})
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_REQUIRED: Any = object()


class KeyReader:
    """Reads the keys of one GGUF file (``gguf_parser.GGUFContents.fields``). A missing key returns
    ``default`` or, without one, raises. Floats must be finite."""

    def __init__(self, fields: Mapping[str, GGUFField], path: Path) -> None:
        self._fields = fields
        self._path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def int(self, key: str, default: Any = _REQUIRED, maximum: int | None = None) -> Any:
        """An integer key; with ``maximum``, a value above it raises (a count the file cannot back)."""
        value = self._scalar(key, _INT_TYPES, "an integer", int, default)
        if maximum is not None and value is not None and value > maximum:
            raise ModelFormatError(f"{self._path}: key {key} = {value} is more than this file can hold (at most {maximum})")
        return value

    def float(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._scalar(key, _FLOAT_TYPES, "a float", float, default)
        if value is not None and not math.isfinite(value):
            raise ModelFormatError(f"{self._path}: key {key} = {value} is not a finite number")
        return value

    def bool(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._scalar(key, frozenset({GGUFValueType.BOOL}), "a bool", bool, default)

    def str(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._scalar(key, frozenset({GGUFValueType.STRING}), "a string", str, default)

    def json(self, key: str, default: Any = _REQUIRED) -> Any:
        """A string key holding a JSON object, parsed to a dict."""
        text = self.str(key, default=None)
        if text is None:
            return self._missing(key, default)
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ModelFormatError(f"{self._path}: key {key} is not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ModelFormatError(f"{self._path}: key {key} should hold a JSON object, found {type(value).__name__}")
        return value

    def str_list(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, frozenset({GGUFValueType.STRING}), "strings", str, default)

    def float_list(self, key: str, default: Any = _REQUIRED) -> Any:
        values = self._array(key, _FLOAT_TYPES, "floats", float, default)
        if values is not None and not all(math.isfinite(value) for value in values):
            raise ModelFormatError(f"{self._path}: key {key} holds a value that is not a finite number")
        return values

    def int_list(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, _INT_TYPES, "integers", int, default)

    def bool_list(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, frozenset({GGUFValueType.BOOL}), "bools", bool, default)

    def _scalar(self, key: str, allowed: frozenset, what: str, cast: type, default: Any) -> Any:
        field = self._fields.get(key)
        if field is None:
            return self._missing(key, default)
        if len(field.types) != 1 or field.types[0] not in allowed:
            raise ModelFormatError(f"{self._path}: key {key} should be {what}, found {self._type_name(field.types)}")
        return cast(field.value)

    def _array(self, key: str, allowed: frozenset, what: str, cast: type, default: Any) -> list:
        field = self._fields.get(key)
        if field is None:
            return self._missing(key, default)
        if len(field.types) < 2 or field.types[0] != GGUFValueType.ARRAY or field.types[-1] not in allowed:
            raise ModelFormatError(f"{self._path}: key {key} should be an array of {what}, found {self._type_name(field.types)}")
        return [cast(value) for value in field.value]

    def _missing(self, key: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise ModelFormatError(f"{self._path}: missing key {key}")
        return default

    @staticmethod
    def _type_name(types: tuple[GGUFValueType, ...]) -> str:
        return "[" + " of ".join(t.name for t in types) + "]" if len(types) > 1 else types[0].name
