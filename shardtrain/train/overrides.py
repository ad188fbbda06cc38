"""`--set a.b=v` overrides and JSON round trips for the nested frozen config dataclasses (no central config).

nanoGPT's configurator idea without `exec`: the value is coerced by the field's declared type, and an unknown
key raises with the valid keys of that level listed. Supported field types: bool, int, float, str, X | None,
tuple[T, ...], and nested config dataclasses (set their leaves: `stream.bucket.max_batch_seconds=60`).
"""
from __future__ import annotations

import ast
import dataclasses
import types
import typing
from typing import Any


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(value: str, tp: Any, key: str) -> Any:
    """Parse the string `value` as type `tp`; the error names `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and value.strip().lower() in ("none", "null", ""):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError("; ".join(errors))
    if tp is bool:
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {key}: expected a bool (true/false), got {value!r}")
    if tp in (int, float):
        try:
            out = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {key}: expected {tp.__name__}, got {value!r}") from None
        if isinstance(out, bool) or not isinstance(out, (int, float)) or (tp is int and not isinstance(out, int)):
            raise ValueError(f"--set {key}: expected {tp.__name__}, got {value!r}")
        return tp(out)
    if tp is str:
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        parts = [p for p in value.strip().strip("()[]").split(",") if p.strip()]
        elem = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if elem is None and len(parts) != len(args):
            raise ValueError(f"--set {key}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(coerce(p.strip(), elem or args[i], key) for i, p in enumerate(parts))
    if dataclasses.is_dataclass(tp):
        names = ", ".join(f"{key}.{f.name}" for f in dataclasses.fields(tp))
        raise ValueError(f"--set {key}: is a section; set one of its fields: {names}")
    raise ValueError(f"--set {key}: cannot parse a value of type {tp!r}")


def apply_override(cfg: Any, dotted: str, value: str, prefix: str = "") -> Any:
    """Return a copy of `cfg` with the field at `dotted` set from the string `value`."""
    head, _, rest = dotted.partition(".")
    fields = {f.name for f in dataclasses.fields(cfg)}
    full = prefix + head
    if head not in fields:
        valid = ", ".join(prefix + f for f in sorted(fields))
        raise ValueError(f"--set {full}: unknown config key; valid keys here: {valid}")
    tp = _hints(type(cfg))[head]
    if rest:
        sub = getattr(cfg, head)
        if not dataclasses.is_dataclass(sub):
            raise ValueError(f"--set {full}: is not a section, so {full}.{rest} does not exist")
        return dataclasses.replace(cfg, **{head: apply_override(sub, rest, value, full + ".")})
    return dataclasses.replace(cfg, **{head: coerce(value, tp, full)})


def apply_overrides(cfg: Any, pairs: list[str] | None) -> Any:
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        cfg = apply_override(cfg, key.strip(), value)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(cls: type, d: dict) -> Any:
    """Rebuild a (nested) config dataclass from `to_dict` output; unknown keys raise."""
    hints = _hints(cls)
    kwargs = {}
    for k, v in d.items():
        if k not in hints:
            raise ValueError(f"{cls.__name__}: unknown key {k!r} in stored config")
        tp = hints[k]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        sub = next((a for a in args if dataclasses.is_dataclass(a)), None)
        if sub is not None and isinstance(v, dict):
            v = from_dict(typing.cast(type, sub), v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)
