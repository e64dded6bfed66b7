"""Typed options, built and validated one way: documented dataclasses with clear errors.

Every options class calls `check_fields(self)` in its `__post_init__` (types and the fields'
`min` metadata; cross-field checks follow there), so an object built in code and one built from
params are checked alike, and each message starts with the field's name. The stage layer merges
params.yaml's sections (stages/common.py) and hands the result to `from_mapping`, which adds
unknown/missing-key checks and prefixes every message with where the values came from (e.g.
`params.yaml sft.max_steps: must be >= 1, got -3`); options classes never name params.yaml. (A few checks
of single params name it themselves: `models.resolve_model_source` and `load_pretrained`
for model.base, `models._torch_dtype` for model.dtype, `data` for data.mirror_dir.)
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


def check_fields(instance: DataclassInstance) -> None:
    """Each field's type and `min` metadata; the message starts with the field name."""
    hints = typing.get_type_hints(type(instance))
    for spec in dataclasses.fields(instance):
        value = getattr(instance, spec.name)
        if not _accepts(hints[spec.name], value):
            raise PipelineError(f"{spec.name}: expected {_describe(hints[spec.name])}, got {value!r}")
        minimum = spec.metadata.get("min")
        if minimum is not None and value is not None and value < minimum:
            raise PipelineError(f"{spec.name}: must be >= {minimum}, got {value!r}")


def from_mapping(cls: type[T], values: Mapping[str, Any] | None, where: str,
                 origins: Mapping[str, str] | None = None) -> T:
    """Instantiate dataclass `cls` from `values`; every error is one line starting with where the
    failing value came from: `origins[field]` for values merged from several sections, else `where`."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise PipelineError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(fields))})")
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise PipelineError(f"{where}: missing key {missing[0]!r}")
    try:
        return cls(**values)
    except PipelineError as err:   # the class names the field; the caller knows where it came from
        name = str(err).split(":", 1)[0]
        raise PipelineError(f"{(origins or {}).get(name, where)}.{err}") from None


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
