"""YAML (or a dict) → a typed dataclass, with every problem as one `ConfigError` line.

Unknown keys are listed all at once with what was probably meant; values are coerced to the field's
type (YAML reads `2e-4` as text); `--set key=value` overrides apply dotted keys; and when an override
makes a valid file invalid, the error names that override (as the user typed it) instead of the file.
The schemas themselves are in taehv_slurm.common.config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message is one line that names the problem and the fix."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader less YAML 1.1's base-60 numbers: `1:30` is the text "1:30" (as in YAML 1.2),
    not 90 — an env value such as `1:0.25` reached the ranks as 60.25."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, re.compile(r"(?!.*:)" + rx.pattern, rx.flags) if tag.endswith((":int", ":float")) else rx)
            for tag, rx in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def load_yaml(text: str) -> Any:
    """One YAML document, safely, with no base-60 numbers (`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def load_typed(cls: type, path_or_dict: Any, kind: str, overrides: Mapping[str, Any],
               origins: Mapping[str, str] | None,
               resolve: Callable[[Path], Path | None] = lambda p: None) -> Any:
    """`cls` built from `path_or_dict` with `overrides`, validated (`cls.validate(source)`); `resolve`
    finds a path that does not exist from here (e.g. the configs shipped with the package)."""
    data, source = read_yaml(path_or_dict, kind, resolve)
    if path_or_dict is not None and not isinstance(path_or_dict, Mapping):
        # A misspelt key explains a missing one: name it first, with what was meant.
        _reject_unknown(cls, data, source)
        check_required(cls, apply_overrides(data, overrides), source, kind)

    def attempt(data: dict[str, Any], where: str) -> Any:
        return _build(cls, data, where).validate(where)

    try:
        return attempt(apply_overrides(data, overrides), source)
    except ConfigError:
        if not overrides:
            raise
    # Invalid with the overrides: blame the override that broke the config for the last time (applied
    # in order; one that repairs the file, e.g. --set data.path=..., is welcome), else the file itself.
    steps = [(None, data)]
    for key, value in overrides.items():
        steps.append((key, apply_overrides(steps[-1][1], {key: value})))
    culprit = None
    for (_, before), (key, after) in zip(steps, steps[1:]):
        if _valid(cls, before) and not _valid(cls, after):
            culprit = key
    if culprit is None:
        return attempt(steps[-1][1], source)  # raises: the file's own error
    state = next(after for key, after in steps if key == culprit)
    return attempt(state,
                   (origins or {}).get(culprit) or f"override {culprit}={overrides[culprit]!r}")  # raises


def _valid(cls: type, data: dict[str, Any]) -> bool:
    try:
        _build(cls, data, "").validate("")
    except ConfigError:
        return False
    return True


def parse_set_args(items: list[str] | None) -> dict[str, Any]:
    """`["nodes=2", "env.NCCL_DEBUG=INFO"]` → {"nodes": 2, "env.NCCL_DEBUG": "INFO"} (values as YAML)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set nodes=2")
        try:
            out[key.strip()] = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def check_required(cls: type, data: Mapping[str, Any], source: str, kind: str) -> None:
    """A config file (with its overrides) must give `cls.REQUIRED_KEYS`: ConfigError listing the missing."""
    missing = [key for key in getattr(cls, "REQUIRED_KEYS", ()) if not _has(data, key.split("."))]
    if missing:
        example = "configs/train/tiny.yaml" if "train" in kind else "configs/cluster/local.yaml"
        raise ConfigError(f"{source}: missing required key{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(missing)}; add them (see {example}) or give them with --set")


def _has(data: Any, parts: list[str]) -> bool:
    return not parts or (isinstance(data, Mapping) and parts[0] in data and _has(data[parts[0]], parts[1:]))


def read_yaml(path_or_dict: Any, kind: str,
              resolve: Callable[[Path], Path | None]) -> tuple[dict[str, Any], str]:
    if path_or_dict is None:
        return {}, kind
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), kind
    path = Path(path_or_dict)
    if not path.is_file():
        path = resolve(path) or path
    if not path.is_file():
        raise ConfigError(f"{kind} {path} not found: check the path "
                          "(configs/cluster/ and configs/train/ hold examples)")
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}; fix the syntax there") from None
    if data is None:
        return {}, str(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level, "
                          f"got {type(data).__name__}")
    return data, str(path)


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    data = _deep_copy(data)
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[last] = value
    return data


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def _build(cls: type, data: Mapping[str, Any], source: str, prefix: str = "") -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: '{prefix.rstrip('.')}' must be a mapping of key: value, got {data!r}")
    if not prefix:
        _reject_unknown(cls, data, source)
    hints = _hints(cls)
    return cls(**{key: _coerce(value, hints[key], source, f"{prefix}{key}") for key, value in data.items()})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's field types, evaluated once (a config read back from a registry of 10,000 runs is built
    10,000 times)."""
    return typing.get_type_hints(cls)


def _reject_unknown(cls: type, data: Mapping[str, Any], source: str) -> None:
    if unknown := _unknown_keys(cls, data):  # every one at once, not one per run
        raise ConfigError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")


def _unknown_keys(cls: type, data: Any, prefix: str = "") -> list[str]:
    """Every key of `data`, nested sections included, that `cls` does not have, each with what was
    probably meant ('optim.lrr' (did you mean 'optim.lr'?)) or the section's keys."""
    if not isinstance(data, Mapping):
        return []
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    found = []
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            found.append(f"'{prefix}{key}' " + (f"(did you mean '{prefix}{close[0]}'?)" if close
                                                 else "(keys"
                                                      f"{' of ' + prefix.rstrip('.') if prefix else ''}: "
                                                      f"{', '.join(sorted(names))})"))
        elif dataclasses.is_dataclass(hints[key]):
            found += _unknown_keys(hints[key], value, f"{prefix}{key}.")
    return found


def _coerce(value: Any, hint: Any, source: str, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, source, f"{key}.")
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for kind in inner[1:]:  # e.g. int | Literal["auto"]: the first kind the value fits
            try:
                return _coerce(value, kind, source, key)
            except ConfigError:
                continue
        return _coerce(value, inner[0], source, key)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(map(str, args))
            raise ConfigError(f"{source}: '{key}' must be one of {choices}; got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{source}: '{key}' must be a list, got {value!r}")
        return [_coerce(v, args[0], source, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: '{key}' must be a mapping, got {value!r}")
        return {str(k): _coerce(v, args[1], source, f"{key}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: '{key}' must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: '{key}' must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "2e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{source}: '{key}' must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if isinstance(value, bool) or value is None or isinstance(value, list | dict):
            raise ConfigError(f"{source}: '{key}' must be a string, got {value!r}")
        return str(value)
    return value


def check(ok: bool, source: str, message: str) -> None:
    """A config's validation: raise `ConfigError` "<source>: <message>" unless `ok`."""
    if not ok:
        raise ConfigError(f"{source}: {message}")
