"""Typed stage options: build documented dataclasses from plain mappings, with clear errors.

Stage scripts read params.yaml and hand a section to `from_mapping`; the library only
ever sees the dataclass. A wrong key, type or range stops with one line naming the
param (e.g. `params.yaml sft.max_steps: must be >= 1, got -3`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from parallel_r1.errors import PipelineError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` fits a simple annotation (int, float, str, bool, Optional, Literal, list, dict)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or annotation is dict:
        return isinstance(value, Mapping)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def from_mapping(cls: type[T], values: Mapping[str, Any] | None, where: str) -> T:
    """Instantiate dataclass `cls` from `values`, checking keys, types and `min` metadata."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise PipelineError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if not _accepts(hints[name], value):
            raise PipelineError(f"{where}.{name}: expected {_describe(hints[name])}, got {value!r}")
        minimum = fields[name].metadata.get("min")
        if minimum is not None and value is not None and value < minimum:
            raise PipelineError(f"{where}.{name}: must be >= {minimum}, got {value!r}")
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise PipelineError(f"{where}: missing key {missing[0]!r}")
    return cls(**values)


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
