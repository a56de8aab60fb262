"""The typed YAML reader behind cluster.yaml: a frozen dataclass's fields from YAML nodes, each
value checked against its type hint, every error naming FILE:LINE: KEY (config.py holds the keys)."""

from __future__ import annotations

import difflib
import re
import types
from dataclasses import MISSING, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from ...proto.errors import UserError
from ...proto.expert_cache import SIZE_UNITS


class ConfigError(UserError):
    """An invalid cluster.yaml; the message is one line: FILE:LINE: KEY: problem."""


class Size(int):
    """Bytes, written with an optional unit."""


class Duration(float):
    """Seconds, written with an optional unit."""


TIME_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_units(text: str, units: dict[str, float], what: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in units:
        raise ValueError(
            f"{text!r} is not a {what} (e.g. {'1GB, 512MiB' if what == 'size' else '500ms, 5s, 2m'})"
        )
    return float(m[1]) * units[m[2].lower()]


class Reader:
    def __init__(self, source: str):
        self.source = source

    def fail(self, node: yaml.Node, key: str, problem: str) -> ConfigError:
        line = node.start_mark.line + 1 if node is not None else 1
        return ConfigError(
            f"{self.source}:{line}: {key}: {problem}" if key else f"{self.source}:{line}: {problem}"
        )

    def read(self, node: yaml.Node, tp: Any, key: str) -> Any:
        origin = get_origin(tp)
        if origin is Union or origin is types.UnionType:
            options = [a for a in get_args(tp) if a is not type(None)]
            if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
                if type(None) in get_args(tp):
                    return None
            return self.read(node, options[0], key)
        if origin is Literal:
            value = self.scalar(node, key, str)
            if value not in get_args(tp):
                raise self.fail(
                    node, key, f"must be one of {', '.join(get_args(tp))} (got {value!r})"
                )
            return value
        if origin is list:
            if not isinstance(node, yaml.SequenceNode):
                raise self.fail(node, key, "must be a list")
            (item,) = get_args(tp)
            return [self.read(n, item, f"{key}[{i}]") for i, n in enumerate(node.value)]
        if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
            return self.dataclass(node, tp, key)
        return self.scalar(node, key, tp)

    def scalar(self, node: yaml.Node, key: str, tp: type) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(
                node,
                key,
                f"must be a single value, not a {'list' if isinstance(node, yaml.SequenceNode) else 'mapping'}",
            )
        value = (
            yaml.safe_load(yaml.serialize(node))
            if node.tag != "tag:yaml.org,2002:str"
            else node.value
        )
        try:
            if tp is Size:
                n = (
                    value
                    if isinstance(value, int) and not isinstance(value, bool)
                    else parse_units(str(value), SIZE_UNITS, "size")
                )
                if n < 0:
                    raise ValueError("must not be negative")
                return Size(int(n))
            if tp is Duration:
                t = (
                    float(value)
                    if isinstance(value, (int, float)) and not isinstance(value, bool)
                    else parse_units(str(value), TIME_UNITS, "duration")
                )
                if t <= 0:
                    raise ValueError("must be positive")
                return Duration(t)
        except ValueError as exc:
            raise self.fail(node, key, str(exc)) from None
        if tp is bool:
            if not isinstance(value, bool):
                raise self.fail(node, key, f"must be true or false (got {node.value!r})")
            return value
        if tp is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise self.fail(node, key, f"must be a whole number (got {node.value!r})")
            return value
        if tp is float:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise self.fail(node, key, f"must be a number (got {node.value!r})")
            return float(value)
        if tp is str:
            if value is None or isinstance(value, (dict, list)):
                raise self.fail(node, key, "must be a string")
            return str(node.value)
        raise AssertionError(f"unsupported config type {tp}")

    def dataclass(self, node: yaml.Node, cls: type, key: str) -> Any:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, key, "must be a mapping of keys to values")
        hints = get_type_hints(cls, include_extras=False)
        known = {f.name: f for f in fields(cls) if f.name != "source"}
        values: dict[str, Any] = {}
        seen: dict[str, yaml.Node] = {}
        for knode, vnode in node.value:
            name = str(knode.value)
            full = f"{key}.{name}" if key else name
            if name not in known:
                hint = difflib.get_close_matches(name, known, n=1)
                raise self.fail(
                    knode,
                    full,
                    "unknown key"
                    + (
                        f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(known)})"
                    ),
                )
            if name in seen:
                raise self.fail(knode, full, "given twice")
            seen[name] = knode
            values[name] = self.read(vnode, hints[name], full)
        for name, f in known.items():
            if name not in values and f.default is MISSING and f.default_factory is MISSING:
                raise self.fail(node, f"{key}.{name}" if key else name, "is required")
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise self.fail(node, key, str(exc)) from None


def find_node(root: yaml.Node, *path: str | int) -> yaml.Node:
    """The YAML node at a key path (for line numbers of cross-field errors)."""
    node = root
    for p in path:
        if isinstance(p, int) and isinstance(node, yaml.SequenceNode) and p < len(node.value):
            node = node.value[p]
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == p:
                    node = v
                    break
            else:
                return node
        else:
            return node
    return node
