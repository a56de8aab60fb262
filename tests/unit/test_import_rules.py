"""The layout's import rules, checked on the source: request and record types import no mlx,
`coordinator/serve/` never imports `coordinator/plan/` or `coordinator/bench/`, `node/` never
imports `coordinator/`, `proto/` imports no other package of the project, the shared plumbing
(`common/`) imports only `proto/`, the envoy imports neither the node nor the coordinator, the
coordinator's serving code takes no plumbing from the envoy's or the node's package, the model
description (`node/describe.py`) imports none of the modules that take it, and no two modules
import each other (directly or through others).

The static check parses every file with `ast`, resolves relative imports, and follows imports
transitively inside the project, function-level imports included (they run too, only later);
imports under `if TYPE_CHECKING:` are skipped (they never run). The no-mlx rule is also checked
by importing the record modules in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "common",
    "coordinator",
    "node",
    "envoy",
    "proto",
)  # folders installed as moe_cluster.<name>
DIST = "moe_cluster"


@dataclass(frozen=True)
class Rule:
    name: str
    scope: tuple[str, ...]  # modules (or packages, by prefix) the rule is about
    forbidden: tuple[str, ...]  # modules (or packages, by prefix) they must not reach


RULES = (
    Rule(
        "records import no mlx",
        (
            "proto.records",
            "proto.placement",
            "proto.profile",
            "proto.transport",
            "proto.frame",
            "node.collective.specs",
        ),
        ("mlx", "mlx_lm"),
    ),
    Rule(
        "serve/ imports neither plan/ nor bench/",
        ("coordinator.serve",),
        ("coordinator.plan", "coordinator.bench"),
    ),
    Rule("node/ imports no coordinator/", ("node",), ("coordinator",)),
    # proto holds the contracts, records and wire constants every process shares: it is the bottom
    Rule(
        "proto/ imports no other package of the project",
        ("proto",),
        ("common", "coordinator", "node", "envoy"),
    ),
    # the shared plumbing (worker thread, gRPC loop and auth, ports, mDNS) stands on proto/ alone,
    # and every process takes it from there, not from another process's package
    Rule("common/ imports only proto/", ("common",), ("coordinator", "node", "envoy")),
    Rule("envoy/ imports neither node/ nor coordinator/", ("envoy",), ("node", "coordinator")),
    # one description of a model (node/describe.py) that loader, shard cache, shipper, planner and
    # load check take: it reads the checkpoint for them, so it never reaches back into one of them
    Rule(
        "the model description imports none of its users",
        ("node.describe",),
        (
            "node.moe.load",
            "node.cache",
            "node.catalog",
            "node.shard_layout",
            "node.ship",
            "node.runtime",
            "node.agent",
            "coordinator",
        ),
    ),
    Rule(
        "serve/ takes no plumbing from the node's or the envoy's packages",
        ("coordinator.serve",),
        ("envoy.auth", "envoy.main", "envoy.mesh", "node.worker", "node.mdns", "node.agent"),
    ),
)

# (importer, imported) edges allowed for now, each with the change that removes it. The test
# fails when an entry is no longer needed, so this list cannot outlive its reason.
KNOWN: set[tuple[str, str]] = set()


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """{dotted module name without the `moe_cluster.` prefix: file}; a package is its __init__."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom in the tree, at any depth, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """{project module: modules it imports}. Project modules are named relative to the
    distribution (`coordinator.serve.up`); others keep their absolute name (`mlx.core`).
    Importing `a.b.c` runs the package `a.b` first, so every module imports its parent."""
    modules = _modules(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:
                parts = [DIST, *package.split(".")]
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            subs = [f"{base}.{a.name}" for a in node.names]
            subs = [
                s for s in subs if s.removeprefix(DIST + ".") in modules
            ]  # `from pkg import submodule`
            targets.update(subs)
            if len(subs) < len(node.names):  # some names are attributes of `base` itself
                targets.add(base)
        edges = {t.removeprefix(DIST + ".") for t in targets}
        if "." in name:
            edges.add(name.rpartition(".")[0])
        edges.discard(name)
        edges.discard(DIST)
        graph[name] = {t for t in edges if t in modules or t.split(".")[0] not in packages}
    return graph


def _bound_names(tree: ast.Module) -> set[str] | None:
    """Names a module binds at its top level (None if it star-imports: anything goes)."""
    names: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:  # the module's own statements, into if/try/with blocks, not into defs
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    return None
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _extensions(root: Path) -> set[str]:
    """The C modules pyproject.toml has the install build (without the `moe_cluster.` prefix)."""
    import tomllib

    with open(root / "pyproject.toml", "rb") as f:
        table = tomllib.load(f).get("tool", {}).get("setuptools", {})
    return {e["name"].removeprefix(DIST + ".") for e in table.get("ext-modules", [])}


def unresolved_imports(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """`from <project module> import name` where name is neither a submodule (a C module the
    install builds counts) nor bound in the module: an import that fails when it runs (a
    function-level one only when it is called)."""
    modules = _modules(root, packages)
    built = _extensions(root) if (root / "pyproject.toml").exists() else set()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    bound = {name: _bound_names(tree) for name, tree in trees.items()}
    bad = []
    for name, tree in trees.items():
        package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_nodes(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = [DIST, *package.split(".")]
                base = ".".join(
                    parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else [])
                )
            else:
                base = node.module or ""
            base = base.removeprefix(DIST + ".")
            if base.split(".")[0] not in packages:
                continue
            if base not in modules:
                bad.append(f"{name}:{node.lineno}: no module {base}")
                continue
            for a in node.names:
                if (
                    a.name != "*"
                    and f"{base}.{a.name}" not in modules
                    and f"{base}.{a.name}" not in built
                    and bound[base] is not None
                    and a.name not in bound[base]
                ):
                    bad.append(f"{name}:{node.lineno}: {base} has no {a.name!r}")
    return bad


def violations(
    graph: dict[str, set[str]], rules=RULES, allowed=frozenset()
) -> dict[tuple[str, str], str]:
    """{(importer, forbidden module): "rule: chain"} for every forbidden module reachable from a
    rule's scope. The walk stops at forbidden modules and at `allowed` edges."""
    found: dict[tuple[str, str], str] = {}
    for rule in rules:
        for start in sorted(m for m in graph if _under(m, rule.scope)):
            parent = {start: None}
            todo = [start]
            while todo:
                m = todo.pop()
                for t in sorted(graph.get(m, ())):
                    if (m, t) in allowed or t in parent:
                        continue
                    if _under(t, rule.scope) and not _under(t, rule.forbidden):
                        continue  # walked from its own start
                    parent[t] = m
                    if _under(t, rule.forbidden):
                        chain, x = [t], m
                        while x is not None:
                            chain.append(x)
                            x = parent[x]
                        found.setdefault((m, t), f"{rule.name}: {' -> '.join(reversed(chain))}")
                    else:
                        todo.append(t)
    return found


def test_the_project_keeps_its_import_rules():
    bad = violations(import_graph(ROOT), allowed=KNOWN)
    assert not bad, "\n".join(bad.values())


def test_every_project_import_resolves():
    bad = unresolved_imports(ROOT)
    assert not bad, "\n".join(bad)


def test_every_known_exception_is_still_needed():
    graph = import_graph(ROOT)
    stale = [edge for edge in KNOWN if edge not in violations(graph)]
    assert not stale, f"KNOWN entries no longer needed (remove them): {stale}"


def test_records_import_no_mlx_when_imported():
    """Every module of the no-mlx rule's scope, imported in a fresh interpreter: an import the
    source does not show (a dependency's, `importlib`) counts too."""
    (scope,) = (rule.scope for rule in RULES if rule.name == "records import no mlx")
    code = (
        f"import {', '.join(f'{DIST}.{m}' for m in scope)}; import sys; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')); assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def test_the_checker_finds_violations(tmp_path):
    root = _tree(
        tmp_path,
        {
            "coordinator/__init__.py": "",
            "coordinator/serve/__init__.py": "",
            "coordinator/serve/api.py": "from .helper import x\n",
            # indirect, inside a function, relative two levels up
            "coordinator/serve/helper.py": "def x():\n    from ..plan import model\n",
            "coordinator/plan/__init__.py": "",
            "coordinator/plan/model.py": "",
            "coordinator/bench/__init__.py": "",
            "coordinator/bench/run.py": "",
            "coordinator/serve/typed.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..bench import run\n"
            ),
            "node/__init__.py": "",
            "node/engine.py": (
                "import moe_cluster.coordinator.serve.api\n"
                "from moe_cluster.coordinator.serve.missing import z\n"
            ),
            "proto/__init__.py": "",
            "proto/records.py": "from .convert import y\n",
            "proto/convert.py": "import mlx.core as mx\n",
            "proto/placement.py": "",
        },
    )
    bad = violations(import_graph(root))
    assert set(bad) == {
        ("coordinator.serve.helper", "coordinator.plan.model"),
        ("node.engine", "coordinator.serve.api"),
        ("proto.convert", "mlx.core"),
    }, bad
    assert bad[("proto.convert", "mlx.core")].endswith("proto.records -> proto.convert -> mlx.core")
    assert bad[("coordinator.serve.helper", "coordinator.plan.model")].endswith(
        "coordinator.serve.helper -> coordinator.plan.model"
    )
    assert unresolved_imports(root) == [
        "node.engine:2: no module coordinator.serve.missing",
        "proto.records:1: proto.convert has no 'y'",
    ]
    allowed = {("coordinator.serve.helper", "coordinator.plan.model")}
    assert set(violations(import_graph(root), allowed=allowed)) == {
        ("node.engine", "coordinator.serve.api"),
        ("proto.convert", "mlx.core"),
    }


def test_a_c_module_the_install_builds_resolves_and_an_undeclared_one_does_not(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pyproject.toml": """
                [[tool.setuptools.ext-modules]]
                name = "moe_cluster.node.collective._sum"
                sources = ["node/collective/_sum.c"]
            """,
            "node/__init__.py": "",
            "node/collective/__init__.py": "",
            "node/collective/reduce.py": "from . import _sum\nfrom . import _other\n",
        },
    )
    assert unresolved_imports(root) == ["node.collective.reduce:2: node.collective has no '_other'"]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles among project modules (Tarjan's strongly connected components of more than
    one module), counting only the imports written in the source: a submodule's implicit import of
    its own package (which may import the submodule back, as any package does) is no circle."""
    explicit = {
        m: {t for t in ts if t in graph and not m.startswith(t + ".")} for m, ts in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(explicit):
        if root in index:
            continue
        work = [(root, iter(sorted(explicit[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(explicit[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_project_has_no_import_circle():
    found = cycles(import_graph(ROOT))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_circle_is_found():
    """The check can fail: two modules importing each other (through a function-level import too)."""
    graph = {
        "node.a": {"node.b"},
        "node.b": {"node.a", "node"},
        "node": {"node.b"},
        "node.c": {"node"},
    }
    assert cycles(graph) == [["node.a", "node.b"]]
