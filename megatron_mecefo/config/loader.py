"""Strict config loading: dataclass defaults <- YAML file <- CLI dotlist (`a.b=value`).

Unknown keys and ill-typed values are `ConfigError`s naming the dotted key and what is allowed.
A nested dataclass field may be given as a string: it names a YAML file, either a preset
`<config_root>/<field>/<name>.yaml` (e.g. `model: tiny` -> `configs/model/tiny.yaml`; the
project's own `configs/` too, so a config copied out of the repository still finds its presets)
or a path. Unknown keys are reported before any preset is read, so a typo is named first.
Pure Python (no torch): `sim/` uses it too.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from megatron_mecefo.errors import ConfigError

T = TypeVar("T")
_PRESET = "__preset__"
PROJECT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
"""The repository's `configs/` (presets are looked up there after the config file's own root)."""


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML mapping; a missing file, bad syntax or a non-mapping is a `ConfigError`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{p}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of keys to values")
    return data


def parse_dotlist(items: list[str]) -> dict[str, Any]:
    """Turn `["training.lr=3e-4", "model=tiny"]` into a nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. training.lr=3e-4)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if isinstance(nxt, str):  # `model=tiny model.num_layers=3`: preset, then keys on top
                nxt = node[part] = {_PRESET: nxt}
            if not isinstance(nxt, dict):
                raise ConfigError(
                    f"override {item!r} conflicts with an earlier override of {part!r}"
                )
            node = nxt
        node[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `override` wins. Inputs are not modified."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    config_root: str | os.PathLike | None = None,
) -> T:
    """Build `cls` from its defaults, then the YAML file at `path`, then dotlist `overrides`.

    Args:
        cls: a dataclass type.
        path: YAML file; its grandparent directory is the default `config_root`.
        overrides: `key.sub=value` strings (CLI dotlist).
        config_root: where preset names for nested dataclasses are looked up.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
        _check_keys(cls, data, "")
        if config_root is None:
            config_root = Path(path).resolve().parent.parent
    if overrides:
        over = parse_dotlist(overrides)
        _check_keys(cls, over, "")
        data = _merge_overrides(cls, data, over, config_root)
    return from_dict(cls, data, config_root=config_root)


def _check_keys(cls: type, data: Any, prefix: str) -> None:
    """Name the first unknown key anywhere in `data` (presets given by name are checked when
    they are read)."""
    if not isinstance(data, dict):
        return
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields - {_PRESET})
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(f"unknown config key '{key}' (allowed: {', '.join(sorted(fields))})")
    hints = _hints(cls)
    for name, value in data.items():
        sub = _dataclass_in(hints.get(name))
        if sub is not None and isinstance(value, dict):
            _check_keys(sub, value, f"{prefix}{name}.")


def _merge_overrides(cls: type, data: dict, over: dict, root: Any) -> dict:
    """Merge CLI overrides; a preset string in the file is expanded first so its keys survive."""
    hints = _hints(cls)
    out = dict(data)
    for key, value in over.items():
        typ = hints.get(key)
        sub_cls = _dataclass_in(typ) if typ is not None else None
        if sub_cls is not None and isinstance(value, dict):
            base = out.get(key, {})
            if _PRESET in value:
                value = dict(value)
                base = value.pop(_PRESET)
            if isinstance(base, str):
                base = read_yaml(_resolve_preset(key, base, root))
            out[key] = _merge_overrides(sub_cls, base or {}, value, root)
        else:
            out[key] = value
    return out


def from_dict(cls: type[T], data: Any, *, prefix: str = "", config_root: Any = None) -> T:
    """Validate `data` against dataclass `cls` and construct it (recursively)."""
    if isinstance(data, str):
        data = read_yaml(_resolve_preset(prefix.rstrip(".") or cls.__name__, data, config_root))
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(f"unknown config key '{key}' (allowed: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, prefix + name, config_root)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        where = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"{where}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain YAML-able structure (enums become their values)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_in(typ: Any) -> type | None:
    if dataclasses.is_dataclass(typ):
        return typ
    if _is_union(typ):
        for arg in get_args(typ):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _is_union(typ: Any) -> bool:
    return get_origin(typ) in (Union, types.UnionType)


def _resolve_preset(key: str, name: str, root: Any) -> Path:
    field = key.rsplit(".", 1)[-1]
    roots = [Path(r) for r in (root, PROJECT_CONFIGS) if r is not None]
    candidates = [r / field / f"{name}.yaml" for r in roots] + [Path(name)]
    for cand in candidates:
        if cand.is_file():
            return cand
    names = sorted({p.stem for r in roots for p in (r / field).glob("*.yaml")})
    avail = f" (available presets: {', '.join(names)})" if names else ""
    raise ConfigError(f"{key}: no preset or file named {name!r}{avail}")


def _type_name(typ: Any) -> str:
    return getattr(typ, "__name__", str(typ).replace("typing.", ""))


def _convert(typ: Any, value: Any, key: str, root: Any) -> Any:  # noqa: C901 - a type switch
    origin = get_origin(typ)
    if typ is Any:
        return value
    if _is_union(typ):
        args = get_args(typ)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key, root)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        allowed = get_args(typ)
        if value not in allowed:
            raise ConfigError(
                f"{key}: {value!r} is not allowed (allowed values: {', '.join(map(repr, allowed))})"
            )
        return value
    if dataclasses.is_dataclass(typ):
        return from_dict(typ, value, prefix=key + ".", config_root=root)
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        try:
            return typ(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in typ)
            raise ConfigError(
                f"{key}: {value!r} is not allowed (allowed values: {allowed})"
            ) from None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_t, *_rest) = get_args(typ) or (Any,)
        items = [_convert(item_t, v, f"{key}[{i}]", root) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, val_t = get_args(typ) or (Any, Any)
        return {k: _convert(val_t, v, f"{key}.{k}", root) for k, v in value.items()}
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {_type_name(typ)}")
