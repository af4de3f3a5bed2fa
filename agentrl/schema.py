"""Typed dataclasses from plain mappings, with one-line errors naming the bad key: the part of the
config system that recipes use for their own knobs (``extra:``), below the config loader, which knows
the recipes."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    pass


def _type_ok(tp: Any, value: Any) -> tuple[bool, Any, str]:
    """(ok, converted value, description of what is allowed)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return value in args, value, "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        for a in args:
            if a is type(None):
                if value is None:
                    return True, None, ""
                continue
            ok, v, _ = _type_ok(a, value)
            if ok:
                return True, v, ""
        return False, value, " or ".join(_type_ok(a, object())[2] or "null" for a in args)
    if origin is list:
        if not isinstance(value, list):
            return False, value, "a list"
        return True, value, ""
    if origin is dict:
        return isinstance(value, dict), value, "a mapping"
    if tp is bool:
        return isinstance(value, bool), value, "true or false"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if tp is float:  # finite: a NaN or infinite temperature, lr or coefficient trains to the end on NaN losses
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                f = float(value)
            except ValueError:
                return False, value, "a number (finite)"
            return math.isfinite(f), f, "a number (finite)"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            ok = ok and math.isfinite(value)
        except OverflowError:  # an int too large for a float
            ok = False
        return ok, float(value) if ok else value, "a number (finite)"
    if tp is str:
        return isinstance(value, str), value, "a string"
    return True, value, ""


def build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown key '{prefix}{key}'; allowed: {', '.join(sorted(fields))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build(tp, value, f"{prefix}{key}.")
            continue
        ok, conv, allowed = _type_ok(tp, value)
        if not ok:
            raise ConfigError(f"bad value for '{prefix}{key}': {value!r}; allowed: {allowed}")
        kwargs[key] = conv
    return cls(**kwargs)
