"""docs/families.md holds the sweep's table (table.py writes it there): one row per family of the
installed mlx-lm, and `--write` replaces the table and nothing else."""

from __future__ import annotations

from pathlib import Path

import table
import tiny

DOC = Path(__file__).resolve().parents[2] / "docs" / "families.md"


def _rows(text: str) -> list[str]:
    block = text.split(table.START, 1)[1].split(table.END, 1)[0]
    return [r for r in block.splitlines() if r.startswith("| ") and not r.startswith("| family |")]


def test_the_table_has_a_row_per_family_of_the_installed_mlx_lm():
    """A new mlx-lm family (or a renamed one) shows here: rerun table.py --write docs/families.md."""
    assert [r.split("|")[1].strip() for r in _rows(DOC.read_text())] == tiny.families()


def test_write_replaces_only_the_table():
    text = DOC.read_text()
    new = table.splice(text, ["| family | x |", "|---|---|", "| only | row |"])
    assert _rows(new) == ["| only | row |"]
    assert new.split(table.START)[0] == text.split(table.START)[0]
    assert new.split(table.END)[1] == text.split(table.END)[1]
    old = text.split(table.START, 1)[1].split(table.END, 1)[0].strip("\n").splitlines()
    assert table.splice(new, old) == text
