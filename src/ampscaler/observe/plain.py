"""The observers' results as plain, JSON-ready data and back, read from their dataclass fields.

:class:`Plain` gives a frozen dataclass ``as_dict()`` and ``from_dict()``: a field becomes its
value, a nested dataclass a dict, a tuple a list, a non-finite float its string (``"inf"``,
``"-inf"``, ``"nan"``: every line of a JSONL log stays strict JSON). Reading back converts each
value to its field's annotated type, so ``"inf"`` becomes ``math.inf`` again; a key that is
missing takes the field's default (logs written before a field existed still read), and keys
that are not fields are ignored.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Reading(Plain):
    ...     value: float
    ...     names: tuple[str, ...] = ()
    >>> Reading(float("inf"), ("a",)).as_dict()
    {'value': 'inf', 'names': ['a']}
    >>> Reading.from_dict({"value": "inf", "other": 1})
    Reading(value=inf, names=())
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["Plain"]

_P = TypeVar("_P", bound="Plain")


class Plain:
    """What a frozen dataclass inherits to turn into plain data and back (module docstring)."""

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: the fields by name; non-finite floats as strings."""
        plain: dict[str, Any] = _plain(self)
        return plain

    @classmethod
    def from_dict(cls: type[_P], data: Mapping[str, Any]) -> _P:
        """The inverse of :meth:`as_dict`.

        Raises:
            TypeError, ValueError, AttributeError: a field is missing or has the wrong type.
        """
        fields = _typed_fields(cls)
        return cls(**{name: _typed(hint, data[name]) for name, hint in fields if name in data})


#: ``(name, annotated type)`` of each field, per class (read once per class).
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _typed_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    return _FIELDS[cls]


def _plain(value: object) -> Any:
    if isinstance(value, Plain):
        names = [f.name for f in dataclasses.fields(value)]  # type: ignore[arg-type]
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _typed(hint: Any, value: Any) -> Any:
    """``value`` (plain data) as the type ``hint`` names."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [arg for arg in args if arg is not type(None)]
        return _typed(hint, value)
    if isinstance(hint, type) and issubclass(hint, Plain):
        return hint.from_dict(value)
    if origin is dict:
        return {_typed(args[0], key): _typed(args[1], item) for key, item in value.items()}
    if origin is list:
        return [_typed(args[0], item) for item in value]
    if origin is not None:  # tuple[X, ...], Sequence[X]: held as a tuple
        return tuple(_typed(args[0], item) for item in value)
    return hint(value)
