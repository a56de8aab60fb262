"""docs/configuration.md's table of keys against the validator (coordinator/serve/config.py): the
same set of keys, and each documented default is what leaving the key out gives."""

from __future__ import annotations

import re
import types
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Union, get_args, get_origin, get_type_hints

import pytest

from moe_cluster.coordinator.serve.config import ClusterConfig, parse_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(`[^`]*`|required|—)\s*\|(.+)\|\s*$")


def _unwrap(tp):
    """The type inside `X | None`, and whether None was allowed."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def validator_keys(cls=ClusterConfig, prefix: str = "") -> dict:
    """Every leaf key the validator reads, dotted (`nodes[].name`), with its dataclass field."""
    out = {}
    hints = get_type_hints(cls)
    for f in fields(cls):
        if f.name == "source":  # where the file was read from, not a key
            continue
        tp, _ = _unwrap(hints[f.name])
        if get_origin(tp) is list and is_dataclass(get_args(tp)[0]):
            out.update(validator_keys(get_args(tp)[0], f"{prefix}{f.name}[]."))
        elif is_dataclass(tp):
            out.update(validator_keys(tp, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def documented(text: str) -> dict[str, str]:
    """`key` -> its default cell, from the table under '## Every key'."""
    section = text.split("\n## Every key\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            assert m[1] not in rows, f"docs/configuration.md: {m[1]} has two rows"
            rows[m[1]] = m[2]
    return rows


_OMIT = object()


def _yaml(doc: dict, indent: str = "") -> str:
    """`doc` as YAML, its leaves written as given (`off` stays the word the user writes, which
    yaml.safe_dump would turn into `false`)."""
    out = []
    for k, v in doc.items():
        if isinstance(v, dict):
            out.append(f"{indent}{k}:\n{_yaml(v, indent + '  ')}")
        elif isinstance(v, list):
            items = [_yaml(item, indent + "    ") for item in v]
            out.append(f"{indent}{k}:\n" + "".join(f"{indent}  - " + i.lstrip() for i in items))
        else:
            out.append(f"{indent}{k}: {v}\n")
    return "".join(out)


def _config(key: str, value: str | object = _OMIT) -> ClusterConfig:
    """A minimal valid cluster.yaml where `key` may be given, with `key` set to the YAML text
    `value` if given."""
    doc: dict = {"nodes": [{"name": "a"}]}
    if key.startswith("ship."):
        doc["checkpoint"] = "coordinator"  # ship: applies only there
    if key.startswith("tls."):
        doc["tls"] = {"cert": "c.pem", "key": "k.pem"}
    if value is not _OMIT:
        *parents, leaf = key.split(".")
        where = doc
        for p in parents:
            where = where["nodes"][0] if p == "nodes[]" else where.setdefault(p, {})
        where[leaf] = value
    return parse_config(_yaml(doc), "test.yaml")


def test_the_table_lists_exactly_the_validators_keys():
    docs = set(documented(DOC.read_text()))
    keys = set(validator_keys())
    assert not keys - docs, (
        f"validator keys missing from docs/configuration.md: {sorted(keys - docs)}"
    )
    assert not docs - keys, (
        f"keys in docs/configuration.md unknown to the validator: {sorted(docs - keys)}"
    )


@pytest.mark.parametrize("key", sorted(documented(DOC.read_text())))
def test_each_documented_default_is_the_validators(key):
    cell = documented(DOC.read_text())[key]
    f = validator_keys().get(key)
    if f is None:
        pytest.skip("not a key of the validator (the test above names it)")
    required = f.default is MISSING and f.default_factory is MISSING
    if cell == "required":
        assert required, f"{key}: documented as required, but defaults to {f.default!r}"
    elif cell == "—":
        assert f.default is None, f"{key}: documented as unset, but defaults to {f.default!r}"
    else:
        assert not required, f"{key}: documented default {cell}, but the key is required"
        assert _config(key, cell.strip("`")) == _config(key), f"{key}: {cell} is not the default"


def test_a_wrong_default_or_a_missing_key_is_caught():
    """What the two tests above see when the table drifts from the validator."""
    text = DOC.read_text()
    rows = documented(
        text.replace("| `serving.queue` | `16` |", "| `serving.queue` | `17` |").replace(
            "| `serving.max_tokens` |", "| `serving.max_tokenz` |"
        )
    )
    assert "serving.max_tokens" in set(validator_keys()) - set(rows)
    assert _config("serving.queue", rows["serving.queue"].strip("`")) != _config("serving.queue")


def test_the_annotated_example_is_valid():
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
    c = parse_config(block, "docs/configuration.md")
    assert c.launch == "remote" and c.tls is not None and c.placement.strategy == "profile"
    assert c.api.metrics_auth is True and c.api.max_body == 16_000_000
