"""Typed, checked access to the fields of a JSON object read from a user's file.

Profiles, hardware files and plans are checked field by field at the boundary: the type (a
``true`` is not the number 1, a string is not a size), the range, finiteness, the allowed values.
Every failure is a ``FormatError`` that names the file and the field, so a bad value never gets
as far as the arithmetic that would turn it into a traceback or a wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from ktc.errors import FormatError

_MISSING: Any = object()


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "a boolean", str: "a string", list: "a list",
                                         dict: "an object"}.get(type(value), type(value).__name__)


class Fields:
    """One JSON object of ``what`` (e.g. "hardware profile") from ``path``."""

    def __init__(self, data: Any, path: str, what: str) -> None:
        if not isinstance(data, dict):
            raise FormatError(f"{what} is {_kind(data)}, not a JSON object", path=path)
        self.data, self.path, self.what = data, path, what

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def error(self, key: str, message: str) -> FormatError:
        return FormatError(f"{self.what}: '{key}' {message}", path=self.path)

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise self.error(key, "is missing")
        return default

    def integer(self, key: str, *, default: Any = _MISSING, minimum: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be a whole number, not {_kind(value)} ({value!r})")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be at least {minimum}, not {value}")
        return value

    def number(self, key: str, *, default: Any = _MISSING, minimum: float | None = None,
               positive: bool = False) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, not {_kind(value)} ({value!r})")
        value = float(value)
        if not math.isfinite(value):
            raise self.error(key, f"must be finite, not {value}")
        if positive and not value > 0:
            raise self.error(key, f"must be positive, not {value}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be at least {minimum}, not {value}")
        return value

    def string(self, key: str, *, default: Any = _MISSING, choices: Collection[str] | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, not {_kind(value)} ({value!r})")
        if choices is not None and value not in choices:
            raise self.error(key, f"is {value!r}; expected one of {', '.join(sorted(choices))}")
        return value

    def items(self, key: str, *, default: Any = _MISSING) -> list[Any]:
        value = self._get(key, default)
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, not {_kind(value)}")
        return value

    def mapping(self, key: str, *, default: Any = _MISSING) -> dict[str, Any]:
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, not {_kind(value)}")
        return value

    def version(self, newest: int) -> int:
        """The ``version`` field: a whole number from 1 to ``newest`` (missing means 1)."""
        version = self.integer("version", default=1, minimum=1)
        if version > newest:
            raise FormatError(f"{self.what} version {version} is newer than this ktc reads ({newest})",
                              path=self.path, hint="upgrade ktc")
        return version
