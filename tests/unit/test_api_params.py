"""docs/api.md's parameter table is the API's: every key it lists for a route is one the route
takes or refuses with its reason, every other key is a 400 naming it, and the table and the code
list the same keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_cluster.coordinator.serve import anthropic, openai
from moe_cluster.coordinator.serve.tools import FieldError

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ROUTES = {
    "/v1/completions": (openai.COMPLETION_KEYS, openai.COMPLETION_REFUSED),
    "/v1/chat/completions": (openai.CHAT_KEYS, openai.CHAT_REFUSED),
    "/v1/messages": (anthropic.KEYS, anthropic.REFUSED),
}


def table() -> dict[str, dict[str, str]]:
    """route -> {parameter: its cell} of the table under '## Parameters'."""
    text = DOC.read_text()
    section = text[text.index("## Parameters") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    header = next(line for line in section.splitlines() if line.startswith("| parameter"))
    routes = [c.strip().strip("`") for c in header.strip("|").split("|")[1:]]
    out: dict[str, dict[str, str]] = {r: {} for r in routes}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            for route, cell in zip(routes, cells[1:]):
                out[route][name] = cell
    return out


@pytest.mark.parametrize("route", ROUTES)
def test_the_table_lists_what_each_route_takes_and_refuses(route):
    known, refused = ROUTES[route]
    cells = table()[route]
    listed = {k for k, c in cells.items() if c != "—"}
    assert listed == set(known) | set(refused), (
        sorted(listed - set(known) - set(refused)),
        sorted(set(known) | set(refused) - listed),
    )
    assert {k for k, c in cells.items() if c.startswith("refused")} == set(refused)


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_keys_are_refused_naming_the_key_and_refused_ones_give_their_reason(route):
    known, refused = ROUTES[route]
    openai.check_keys({k: None for k in known}, known, refused, route)
    for key in ("foo_bar", "x" * 5000, "Temperature", ""):
        with pytest.raises(FieldError) as info:
            openai.check_keys({"model": "m", key: 1}, known, refused, route)
        assert info.value.param == key[:100] and "unknown parameter" in str(info.value)
        assert len(str(info.value)) < 300  # a 5,000-character key is quoted cut short
    for key, reason in refused.items():
        with pytest.raises(FieldError) as info:
            openai.check_keys({key: False}, known, refused, route)
        assert info.value.param == key and reason in str(info.value)
