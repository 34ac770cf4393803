"""Typed JSON: a dataclass built from a parsed JSON object, every field checked against its
annotation, so a bad manifest fails with one line that names the field.

The rules come from the annotations alone (``typing.get_type_hints``), so a field added to a
section (``ModelSpec`` included) is checked with no further code. ``ArtifactPath`` marks a
string that names a file inside the artifact: it must be relative and may not climb out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Literal, NewType, Union, get_args, get_origin, get_type_hints

from llmx.errors import ArtifactError

ArtifactPath = NewType("ArtifactPath", str)  # a file of the artifact, relative to its directory
JSON_INT_LIMIT = 2**53  # integers beyond it are not portable JSON (readers round them)


class FieldError(ArtifactError):
    """One manifest field is wrong; ``field`` is its dotted path (``model.vocab_size``)."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field} {problem}")


def render(value: Any, limit: int = 40) -> str:
    """A value as the manifest spells it, shortened for an error line."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    # NEL, U+2028 and other non-printables would split or hide the one error line
    text = "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(tp: Any) -> str:
    """What a type is called in an error line."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        names = [describe(a) for a in get_args(tp) if a is not type(None)]
        text = " or ".join(names)
        return f"{text} or null" if type(None) in get_args(tp) else text
    if origin is Literal:
        return "one of " + ", ".join(render(a) for a in get_args(tp))
    if tp is ArtifactPath:
        return "a path inside the artifact"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp) or (
        "a list" if tp in (list, tuple) or origin in (list, tuple) else "an object")


def check_relative_path(value: str, field: str) -> str:
    """A path a manifest may name: relative, inside the artifact, no ``..``, no drive."""
    posix = PurePosixPath(value)
    if not value or "\0" in value or "\\" in value or posix.is_absolute() or PureWindowsPath(value).drive:
        raise FieldError(field, f"must be a relative path inside the artifact, got {render(value)}")
    if ".." in posix.parts:
        raise FieldError(field, f"must stay inside the artifact (no '..'), got {render(value)}")
    return value


def check_json_value(value: Any, field: str) -> Any:
    """Any JSON value, with numbers every reader agrees on (finite, integers within 2**53)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        if abs(value) > JSON_INT_LIMIT:
            raise FieldError(field, f"is out of range, got {render(value)}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FieldError(field, f"must be a finite number, got {render(value)}")
        return value
    if isinstance(value, list):
        return [check_json_value(v, f"{field}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: check_json_value(v, f"{field}.{k}") for k, v in value.items()}
    raise FieldError(field, f"is not a JSON value, got {render(value)}")


def convert(tp: Any, value: Any, field: str) -> Any:
    """``value`` checked (and built) as type ``tp``; FieldError naming ``field`` if it is not one."""
    origin = get_origin(tp)
    if tp is Any:
        return check_json_value(value, field)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, field)
    if value is None:
        raise FieldError(field, f"must be {describe(tp)}, got null")
    if origin is Literal:
        if value not in get_args(tp):
            raise FieldError(field, f"must be {describe(tp)}, got {render(value)}")
        return value
    if tp is ArtifactPath:
        return check_relative_path(_expect(str, value, field, tp), field)
    if tp in (bool, str):
        return _expect(tp, value, field, tp)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(field, f"must be an integer, got {render(value)}")
        return check_json_value(value, field)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError(field, f"must be a number, got {render(value)}")
        return float(check_json_value(value, field))
    if tp in (list, tuple) or origin in (list, tuple):
        return _convert_list(tp, value, field)
    if tp is dict or origin is dict:
        return _convert_dict(tp, value, field)
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value, field)
    return check_json_value(value, field)  # an annotation this module does not know: any JSON value


def _expect(tp: type, value: Any, field: str, described: Any) -> Any:
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise FieldError(field, f"must be {describe(described)}, got {render(value)}")
    return value


def _convert_union(tp: Any, value: Any, field: str) -> Any:
    options = [a for a in get_args(tp) if a is not type(None)]
    if value is None:
        if type(None) in get_args(tp):
            return None
        raise FieldError(field, f"must be {describe(tp)}, got null")
    for option in options:
        try:
            return convert(option, value, field)
        except FieldError as exc:
            if len(options) == 1 or exc.field != field:
                raise
    raise FieldError(field, f"must be {describe(tp)}, got {render(value)}")


def _convert_list(tp: Any, value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise FieldError(field, f"must be a list, got {render(value)}")
    args = get_args(tp)
    item = args[0] if args else Any
    return [convert(item, v, f"{field}[{i}]") for i, v in enumerate(value)]


def _convert_dict(tp: Any, value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise FieldError(field, f"must be an object, got {render(value)}")
    key_tp, value_tp = get_args(tp) or (str, Any)
    out = {}
    for key, item in value.items():
        where = f"{field}.{key}"
        if key_tp is ArtifactPath:
            check_relative_path(key, f"{field} key {render(key)}")
        out[key] = convert(value_tp, item, where)
    return out


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def from_json(cls: type, data: Any, field: str) -> Any:
    """An instance of dataclass ``cls`` from a JSON object. Unknown keys are ignored (a newer
    writer's additions), or kept in the field named by ``cls.__json_rest__`` if it has one."""
    if not isinstance(data, dict):
        raise FieldError(field, f"must be an object, got {render(data)}")
    types_of = hints(cls)
    rest_field = getattr(cls, "__json_rest__", None)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name == rest_field:
            continue
        where = f"{field}.{f.name}" if field else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FieldError(where, "is missing")
            continue
        if data[f.name] is None and f.default is None:
            kwargs[f.name] = None  # a field at its default of null is valid, however it is annotated
            continue
        kwargs[f.name] = convert(types_of[f.name], data[f.name], where)
    if rest_field:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs[rest_field] = {k: check_json_value(v, f"{field}.{k}") for k, v in data.items() if k not in known}
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if callable(check):
        check(field)
    return obj


def to_json(obj: Any) -> Any:
    """A dataclass (or container of them) as plain JSON values; ``__json_rest__`` fields flattened."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        rest_field = getattr(obj, "__json_rest__", None)
        out = {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != rest_field}
        if rest_field:
            out.update(to_json(getattr(obj, rest_field)))
        return out
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj
