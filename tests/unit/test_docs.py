"""The current docs (README.md and docs/*.md): every relative link resolves (file and anchor),
every `moe-cluster COMMAND` named in code is a subcommand of the CLI's own parser, every command
line of docs/performance.md (the commands that reproduce its figures) parses with that parser,
every scripts/ path named exists, and every file under docs/bench/ is cited by a page (a figure's
JSON goes with the doc that cites it)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCH = ROOT / "docs" / "bench"

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# `moe-cluster` then a lower-case word ending at a space, a backtick, a pipe or the end: a command
COMMAND = re.compile(
    r"(?<![\w-])moe-cluster\s+([a-z][a-z0-9-]*)(?=[\s`|]|$)"
    r"(?:\s+([a-z][a-z0-9-]*(?:\\?\|[a-z][a-z0-9-]*)*)(?=[\s`]|$))?"
)
# a command line shown in code: `moe-cluster` (or .venv/bin/moe-cluster) to a shell operator or the end
SHOWN = re.compile(r"(?:^|(?<=[\s(]))(?:\.venv/bin/)?moe-cluster\s+(.*?)(?=\s(?:>|\||&&|;|2>|#)|$)")
SCRIPT = re.compile(r"(?<![\w/.-])scripts/(?:[a-z0-9_]+/)*[a-z0-9_]+\.(?:py|sh)\b")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def _prose(text: str) -> str:
    """The text outside code: links in code blocks are examples, not links."""
    return INLINE.sub(" ", FENCE.sub(" ", text))


def _code(text: str) -> list[str]:
    """Fenced blocks and inline code spans."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    return blocks + [m.group(2) for m in INLINE.finditer(FENCE.sub(" ", text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub(" ", page.read_text())):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for m in LINK.finditer(_prose(page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{_rel(page)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{_rel(page)}: {target}: no heading #{anchor} in {dest.name}")
    return bad


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def unknown_commands(text: str, where: str, parser: argparse.ArgumentParser) -> list[str]:
    commands = _choices(parser)
    bad = []
    for code in _code(text):
        for m in COMMAND.finditer(code):
            name, sub = m.group(1), m.group(2)
            if name not in commands:
                bad.append(f"{where}: moe-cluster {name}: no such command")
                continue
            subs = _choices(commands[name])
            if subs and sub:
                for s in sub.replace("\\", "").split("|"):
                    if s not in subs:
                        bad.append(f"{where}: moe-cluster {name} {s}: no such {name} command")
    return bad


def shown_commands(text: str) -> list[str]:
    """The argument strings of every command line in code: a fenced block's lines (a trailing
    backslash continues one) and inline spans (a line break inside one is a space)."""
    lines = [
        line for m in FENCE.finditer(text) for line in m.group(0).replace("\\\n", " ").splitlines()
    ]
    lines += [m.group(2).replace("\n", " ") for m in INLINE.finditer(FENCE.sub(" ", text))]
    return [m.group(1).strip() for line in lines for m in SHOWN.finditer(line)]


def unparsed_commands(text: str, where: str, parser: argparse.ArgumentParser) -> list[str]:
    bad = []
    for args in shown_commands(text):
        argv = shlex.split(args)
        if not any(a.startswith("-") for a in argv):
            continue  # a command named (`moe-cluster bench decode`): unknown_commands checks it
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code:
                why = (err.getvalue().strip().splitlines() or ["?"])[-1]
                bad.append(f"{where}: moe-cluster {args}: {why}")
    return bad


def uncited_bench_files(pages: list[Path], bench: Path) -> list[str]:
    """Files under `bench` whose name no page mentions (a link, a command's output path)."""
    text = "\n".join(p.read_text() for p in pages)
    return sorted(f.name for f in bench.iterdir() if f.is_file() and f.name not in text)


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from moe_cluster.coordinator.cli import build_parser

    return build_parser()


def test_pages_are_found():
    names = {_rel(p) for p in PAGES}
    assert {
        "README.md",
        "docs/configuration.md",
        "docs/performance.md",
        "docs/CONTRIBUTING.md",
        "docs/architecture.md",
        "docs/reliability.md",
        "docs/shipping.md",
    } <= names


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_named_command_is_a_subcommand(page, parser):
    assert unknown_commands(page.read_text(), _rel(page), parser) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_named_script_exists(page):
    missing = sorted(
        {m.group(0) for m in SCRIPT.finditer(page.read_text()) if not (ROOT / m.group(0)).exists()}
    )
    assert missing == [], f"{_rel(page)} names scripts that do not exist"


def test_every_command_of_the_performance_page_parses(parser):
    page = ROOT / "docs" / "performance.md"
    assert len(shown_commands(page.read_text())) >= 10
    assert unparsed_commands(page.read_text(), _rel(page), parser) == []


def test_every_figure_file_is_cited_by_a_page():
    assert uncited_bench_files(PAGES, BENCH) == []


def test_the_checks_catch_what_they_look_for(tmp_path, parser):
    """The three checks fail on a page with a broken link, a wrong anchor, a made-up command and
    a made-up bench, and pass on the same page mended."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[a](missing.md) [b](other.md#nope) [c](#page) "
        "[d](other.md#a-code-heading-yes) [e](https://example.com/x)\n"
        "```\nmoe-cluster fly\n```\n"
        "`moe-cluster bench fly`, `moe-cluster up cluster.yaml`\n"
        "`moe-cluster bench decode\\|serve`, `moe-cluster ready: http://x`\n"
    )
    assert len(broken_links(page)) == 2
    assert len(unknown_commands(page.read_text(), "page.md", parser)) == 2
    page.write_text(
        "# Page\n[c](#page) [d](other.md#a-code-heading-yes)\n"
        "`moe-cluster bench decode\\|serve`, `moe-cluster cache rm NAME`\n"
    )
    assert broken_links(page) == [] and unknown_commands(page.read_text(), "page.md", parser) == []


def test_the_command_and_citation_checks_catch_what_they_look_for(tmp_path, parser):
    """A misspelt option, a missing value and a bad type fail to parse (one each); names, shell
    redirections and continued lines do not; an uncited figure file is found."""
    text = (
        "`moe-cluster bench decode --modle demo`, `moe-cluster plan --model`\n"
        "```\nmoe-cluster bench race --model demo \\\n  --nodes x --json > out.json\n```\n"
        "`moe-cluster bench decode`, `moe-cluster bench placement --nodes 3\n--json`\n"
        "```\nmoe-cluster bench race --merge a.json b.json --json > race.json  # merged\n```\n"
    )
    assert len(unparsed_commands(text, "page.md", parser)) == 3
    assert len(shown_commands(text)) == 6
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "cited.json").write_text("{}")
    (tmp_path / "bench" / "orphan.json").write_text("{}")
    (tmp_path / "page.md").write_text("[json](bench/cited.json)\n")
    assert uncited_bench_files([tmp_path / "page.md"], tmp_path / "bench") == ["orphan.json"]


def test_readme_family_count_matches_the_generated_table():
    """The README's summary of families counts the rows of docs/families.md's generated table."""
    table = (ROOT / "docs" / "families.md").read_text().split("do not edit by hand -->", 1)[1]
    rows = [
        r
        for r in table.split("<!-- end of table -->", 1)[0].splitlines()
        if r.startswith("| ") and not r.startswith("| family |")
    ]
    exact = [r for r in rows if r.split("|")[2].strip().startswith("exact")]
    m = re.search(r"(\d+) of its (\d+)", (ROOT / "README.md").read_text())
    assert m, "README.md: the supported-families summary lost its count"
    assert (int(m[1]), int(m[2])) == (len(exact), len(rows))


def test_the_which_to_pick_tables_are_the_race_over_the_presets():
    """The README's "Which to pick" and docs/plan.md's copy of it, and plan.md's networks table,
    are what coordinator/plan/tables.py makes from the presets today."""
    from moe_cluster.coordinator.plan.tables import network_table, readme_table

    readme, plan = (ROOT / "README.md").read_text(), (ROOT / "docs" / "plan.md").read_text()
    table = "\n".join(readme_table())
    for page, text in (("README.md", readme), ("docs/plan.md", plan)):
        assert table in text, (
            f"{page}: regenerate with python -m moe_cluster.coordinator.plan.tables"
        )
    assert "\n".join(network_table()) in plan, "docs/plan.md: the networks table is stale"
