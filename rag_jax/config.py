"""Typed configs from YAML presets plus ``key=value`` overrides, validated before anything runs.

Each component owns a frozen dataclass next to its code (``MeshConfig`` in sharding.py,
``OptimizerConfig`` in train/optim.py, ...); a run config nests them. ``load_config(cls, yaml_path,
overrides)`` builds it from defaults <- YAML <- overrides (dotted keys, e.g. ``optimizer.learning_rate=1e-3``)
and rejects, with the dotted key in the message: unknown keys (with the closest valid name), values of
the wrong type (a float field must be finite: NaN/inf are rejected; an int field takes no fractions), a key given twice (in one YAML mapping or among the overrides), and malformed overrides.
A section whose class has ``CONFIG_PRESETS`` (``ModelConfig``) accepts ``preset: <name>`` to start from a preset
(the MaxText pattern of a base config plus a model file; research note jax_frameworks.md section 1.1).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted key."""


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _mapping_no_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(f"key {key!r} is set twice in the same YAML mapping (line {line})")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_no_duplicates)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str, from_string: bool) -> Any:
    """Check (and, for override strings, parse) ``value`` against the annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return yaml.safe_load(value) if from_string else value
    if origin in (typing.Union, types.UnionType):
        if value is None or (from_string and value.strip().lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, from_string)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={value!r} is not a valid {_type_name(tp)}")
    if origin is typing.Literal:
        parsed = value
        if from_string and not all(isinstance(a, str) for a in args):
            parsed = yaml.safe_load(value)
        if parsed not in args:
            raise ConfigError(f"{key}={value!r} is not one of {list(args)}")
        return parsed
    if dataclasses.is_dataclass(tp):
        if from_string:
            raise ConfigError(f"{key} is a section; set its fields as {key}.<field>=value")
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of {tp.__name__} fields; got {value!r}")
        return value
    if origin in (tuple, list, dict) or tp in (tuple, list, dict):
        if from_string:
            value = yaml.safe_load(value)
        return _check_container(value, tp, key)
    if tp is bool:
        if from_string:
            low = value.strip().lower()
            if low in ("true", "1", "yes"):
                return True
            if low in ("false", "0", "no"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be a bool (true/false)")
    if tp is int:
        if from_string:
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{key}={value!r} must be an integer (e.g. 100), not a fraction or text") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an int, got {type(value).__name__}")
        return value
    if tp is float:
        if from_string or isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r} must be a float") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a float, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number (NaN and infinity are not allowed)")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string, got {type(value).__name__}")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _check_container(value, tp, key):
    origin, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        if len(args) == 2:
            return {_coerce(k, args[0], f"{key}.{k}", False): _coerce(v, args[1], f"{key}.{k}", False)
                    for k, v in value.items()}
        return dict(value)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r} must be a list")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], f"{key}[{i}]", False) for i, v in enumerate(value))
    if origin is tuple and args:
        if len(args) != len(value):
            raise ConfigError(f"{key}={value!r} must have {len(args)} items")
        return tuple(_coerce(v, a, f"{key}[{i}]", False) for i, (v, a) in enumerate(zip(value, args)))
    if origin is list and args:
        return [_coerce(v, args[0], f"{key}[{i}]", False) for i, v in enumerate(value)]
    return type(value)(value) if origin is list else tuple(value)


def _nested_keys(cls, prefix: str = "") -> list[str]:
    """Dotted keys of every field of ``cls``'s sections, recursively (``model.hidden_size``, ...)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        sub = _section_type(hints[f.name]) if f.init else None
        if sub is not None:
            out += [f"{prefix}{f.name}.{k}" for k in [g.name for g in dataclasses.fields(sub) if g.init]]
            out += _nested_keys(sub, f"{prefix}{f.name}.")
    return out


def _unknown(key: str, prefix: str, valid, cls=None) -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    # a field of a section given without its section (``hidden_size`` for ``model.hidden_size``)
    nested = sorted({k for k in (_nested_keys(cls) if cls is not None else []) if k.rsplit(".", 1)[-1] == key})
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    if nested:
        hint = f"; did you mean {' or '.join(repr(prefix + k) for k in nested)}?"
    where = f" in section '{prefix.rstrip('.')}'" if prefix else ""
    return ConfigError(f"unknown config key '{prefix}{key}'{hint} Valid keys{where}: {sorted(valid)}")


def from_dict(cls, data: dict[str, Any] | None, prefix: str = "", _from_string: frozenset = frozenset()):
    """Build dataclass ``cls`` from a nested dict, checking keys and types (see module docstring).

    Raises:
      ConfigError: unknown key, wrong type, or the dataclass's own validation failed (message prefixed
        with the section's dotted key).
    """
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    presets = getattr(cls, "CONFIG_PRESETS", None)  # {name: field values} of a class with presets
    kwargs: dict[str, Any] = {}
    if presets is not None and "preset" in data:
        name = data.pop("preset")
        if name not in presets:
            raise ConfigError(f"{prefix}preset={name!r} is not a known preset; valid: {sorted(presets)}")
        kwargs.update(presets[name])
    for key, value in data.items():
        if key not in fields:
            raise _unknown(key, prefix, list(fields) + (["preset"] if presets is not None else []), cls)
        tp = hints[key]
        dotted = f"{prefix}{key}"
        sub = _section_type(tp)
        if sub is not None and isinstance(value, dict):
            base = _field_default(fields[key])
            if dataclasses.is_dataclass(base) and "preset" not in value:   # a partial section keeps the rest
                value = _merge(to_dict(base), value)                        # of the field's own default
            kwargs[key] = from_dict(sub, value, dotted + ".", _from_string)
        else:
            kwargs[key] = _coerce(value, tp, dotted, dotted in _from_string)
    for key, f in fields.items():
        sub = _section_type(hints[key])
        if key not in kwargs and sub is not None and _field_default(f) is None:   # a section with no default
            kwargs[key] = from_dict(sub, {}, f"{prefix}{key}.", _from_string)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"invalid {prefix.rstrip('.') or cls.__name__}: {e}") from e


def _field_default(f: dataclasses.Field):
    """The field's default value (built by its ``default_factory`` if it has one), or None."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _section_type(tp):
    if dataclasses.is_dataclass(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if is_union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def parse_overrides(args: list[str]) -> tuple[dict[str, Any], frozenset]:
    """``["a.b=1", "c=x"]`` -> (nested dict of raw strings, set of dotted keys).

    Raises:
      ConfigError: an item without ``=``, an empty key, or a key given twice.
    """
    nested: dict[str, Any] = {}
    seen: set[str] = set()
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"override {arg!r} must look like key=value (e.g. train.steps=100)")
        key, value = arg.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {arg!r} has an empty key")
        if key in seen:
            raise ConfigError(f"config key {key!r} is set twice on the command line")
        for other in seen:
            if other.startswith(key + ".") or key.startswith(other + "."):
                raise ConfigError(f"config keys {other!r} and {key!r} overlap; set each field once")
        seen.add(key)
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} goes below a non-section key")
        node[leaf] = value
    return nested, frozenset(seen)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file (duplicate keys rejected).

    Raises:
      ConfigError: the file is missing, unreadable YAML, or not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        reason = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"config file {str(path)!r} is not valid YAML ({where}{reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def load_config(cls, yaml_path: str | Path | None = None, overrides: list[str] = (), *, defaults=None,
                section: str | None = None):
    """The one config loader: ``cls`` defaults <- ``defaults`` <- YAML file <- ``key=value`` overrides, validated
    into ``cls`` (a dataclass of dataclass sections).

    Args:
      defaults: a nested dict of defaults that differ from the dataclasses' own (e.g. the demo's small model),
        or a function of the user's merged YAML + overrides dict returning one (defaults that depend on what
        the user chose, such as a model preset).
      section: a top-level key the YAML file may nest the settings under (e.g. ``em_llm``).

    Raises:
      ConfigError (a ValueError): see :func:`load_yaml`, :func:`parse_overrides` and :func:`from_dict`.
    """
    data = load_yaml(yaml_path) if yaml_path is not None else {}
    if section is not None and isinstance(data.get(section), dict):
        data = data[section]
    nested, keys = parse_overrides(list(overrides))
    user = _merge(data, nested)
    base = defaults(user) if callable(defaults) else (defaults or {})
    return from_dict(cls, _merge(base, user), _from_string=keys)


def to_dict(cfg) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for writing the resolved config next to a run."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x
    return plain(cfg)
