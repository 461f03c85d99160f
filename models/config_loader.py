"""TOML -> dataclass tree, with `--set section.key=value` overrides.

Strict by design: an unknown key, a missing section class, or a value of the
wrong type is a `ValueError` naming the full dotted key (and the file), never a
silent default. Supported field types: int, float, str, bool, `X | None`,
`Literal[...]`, `list[<scalar>]`, nested config dataclasses and
`list[<config dataclass>]` (TOML arrays of tables, whose tables an override names
by their `name` or index).

    >>> cfg = load_config(JobConfig, "configs/demo.toml", ["train.max_steps=10"])
    >>> cfg = load_config(JobConfig, "configs/ml100k.toml", ["sparse.tables.item.embedding_dim=64"])
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")

NONE = "none"
"""How a config file or `--set` turns off a setting whose type admits None (TOML has no null)."""


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if type(None) in args and (value is None or value == NONE):  # TOML has no null: "none"
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ValueError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if _is_config(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"{key}: unsupported config field type {tp}")


def from_dict(cls: type[T], data: dict[str, Any], *, prefix: str = "") -> T:
    """Build config dataclass `cls` from a (TOML) dict; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ValueError(f"unknown config key {key!r} (known keys here: {known})")
        kwargs[name] = _convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field with no default
        raise ValueError(f"{prefix or cls.__name__}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The inverse of `from_dict` (TOML/JSON friendly): a None that is the field's default is
    dropped, another None is written as "none" (dropped, it would read back as the default)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [to_dict(v) for v in value]
        if value is not None:
            out[f.name] = value
        elif f.default is not None and (f.default is not dataclasses.MISSING
                                        or f.default_factory is not dataclasses.MISSING):
            out[f.name] = NONE
    return out


def _parse_override_value(text: str) -> Any:
    """`--set` values are TOML values (`3`, `1e-3`, `true`, `"x"`, `[1, 2]`); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _table_of(tables: list, part: str, dotted: str) -> dict[str, Any]:
    """The element of an array of tables (`[[sparse.tables]]`) that `part` names: by its
    `name` key, else by its index."""
    for table in tables:
        if isinstance(table, dict) and table.get("name") == part:
            return table
    if part.isdigit() and int(part) < len(tables) and isinstance(tables[int(part)], dict):
        return tables[int(part)]
    names = [t["name"] for t in tables if isinstance(t, dict) and "name" in t]
    indices = f"0 to {len(tables) - 1}" if tables else "none"
    raise ValueError(f"--set {dotted}: no table {part!r} here (by name: {', '.join(map(repr, names)) or 'none'}; "
                     f"by index: {indices})")


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """`section.key=value`; an array of tables takes the table's name or index as one more
    part: `sparse.tables.item.embedding_dim=96` or `sparse.tables.0.embedding_dim=96`."""
    if "=" not in assignment:
        raise ValueError(f"--set expects section.key=value, got {assignment!r}")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node: Any = data
    for part in parts[:-1]:
        node = _table_of(node, part, dotted) if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ValueError(f"--set {dotted}: {part!r} is not a section")
    if isinstance(node, list):
        hint = ".".join([*parts[:-1], "<table>", parts[-1]])
        raise ValueError(f"--set {dotted}: {parts[-2]!r} holds several tables: name one, as in {hint}=...")
    node[parts[-1]] = _parse_override_value(text.strip())


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Load `cls` from a TOML file (or defaults when `path` is None) plus `--set` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} " + ("is a directory" if path.is_dir() else "does not exist"))
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
            raise ValueError(f"config file {path}: {e}") from None
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return from_dict(cls, data)
    except ValueError as e:
        where = f" in {path}" if path is not None else ""
        raise ValueError(f"config{where}: {e}") from None
