"""DESIGN §2: which package may import which, and the optimizer's layers top to bottom.

Read from the source with ``ast``, so a violation anywhere (even inside a function) fails here.
The optimizer's subpackages form a stack: a module may import its own layer and the layers
below it, never one above. The pure layers (statistics figures, model, placement, search, plan,
control) import no database, web, cluster, process or event-loop library, directly or through
another optimizer module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"proxy", "optimizer", "shared", "sim", "examples", "bench", "tests"}
ALLOWED = {
    "proxy": {"proxy", "shared"},
    "optimizer": {"optimizer", "shared"},
    "shared": {"shared"},
    "sim": {"sim", "shared"},
    "examples": {"examples"},
}
# Bottom to top: the pipeline (statistics → model → placement → search → plan → control), then
# the edges that touch the world, then what drives them.
LAYERS = (
    "stats",
    "model",
    "placement",
    "search",
    "plan",
    "control",
    "store",
    "profiling",
    "rollout",
    "daemon",
    "demo",
    "cli",
)
PURE = (
    "optimizer.stats.figures",
    "optimizer.stats.scanned",
    "optimizer.stats.sample",
    "optimizer.stats.union",
    "optimizer.stats.modality",
    "optimizer.stats.replica_load",
    "optimizer.model",
    "optimizer.placement",
    "optimizer.search",
    "optimizer.plan",
    "optimizer.control",
)
IMPURE_LIBRARIES = {"duckdb", "aiohttp", "kubernetes", "subprocess", "asyncio"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: Path) -> Iterator[str]:
    """Every absolute module name ``path`` imports (``from a.b import c`` yields ``a.b`` and
    ``a.b.c``: ``c`` may be a module)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module → the modules (ours or not) it imports, for every module under ``root/package``."""
    return {
        _module_name(path, root): set(_imported(path))
        for path in sorted((root / package).rglob("*.py"))
    }


def layer_of(module: str) -> str:
    """``optimizer.search.solve`` → ``search``; ``optimizer.placement`` → ``placement``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import of an optimizer module from a layer above the importer's own."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for module, imports in graph.items():
        mine = layer_of(module)
        if mine not in rank:
            continue
        for target in sorted(imports):
            theirs = layer_of(target)
            if target.startswith("optimizer.") and theirs in rank and rank[theirs] > rank[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


def impure_reach(graph: dict[str, set[str]]) -> list[str]:
    """Each pure module that reaches an impure library, directly or through our modules."""
    bad = []
    for module in graph:
        if not any(module == p or module.startswith(p + ".") for p in PURE):
            continue
        seen, todo = {module}, [module]
        while todo:
            current = todo.pop()
            for target in graph.get(current, set()):
                if target.split(".")[0] in IMPURE_LIBRARIES:
                    bad.append(f"{module} reaches {target} (through {current})")
                elif target in graph and target not in seen:
                    seen.add(target)
                    todo.append(target)
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_design_allows(package: str) -> None:
    bad = {
        module: sorted({name.split(".")[0] for name in imports} & OURS - ALLOWED[package])
        for module, imports in import_graph(ROOT, package).items()
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_every_optimizer_module_sits_in_a_layer() -> None:
    homeless = [m for m in import_graph(ROOT, "optimizer") if m != "optimizer"]
    assert [m for m in homeless if layer_of(m) not in LAYERS] == []


def test_optimizer_layers_import_only_downwards() -> None:
    assert layer_violations(import_graph(ROOT, "optimizer")) == []


def test_pure_layers_reach_no_database_web_cluster_process_or_event_loop() -> None:
    assert impure_reach(import_graph(ROOT, "optimizer")) == []


def test_the_checks_catch_a_bad_import(tmp_path: Path) -> None:
    """The rules above are not vacuous: a model module importing the daemon breaks the layers,
    and a search module importing the store reaches DuckDB."""
    for name, source in {
        "optimizer/__init__.py": "",
        "optimizer/model/__init__.py": "",
        "optimizer/model/alp.py": "def f():\n    from optimizer.daemon import service\n",
        "optimizer/search/__init__.py": "",
        "optimizer/search/solve.py": "from optimizer.store.profiles import save_points\n",
        "optimizer/store/__init__.py": "",
        "optimizer/store/profiles.py": "import duckdb\n",
        "optimizer/daemon/__init__.py": "",
        "optimizer/daemon/service.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    graph = import_graph(tmp_path, "optimizer")
    assert layer_violations(graph) == [
        "optimizer.model.alp (model) imports optimizer.daemon (daemon)",
        "optimizer.model.alp (model) imports optimizer.daemon.service (daemon)",
        "optimizer.search.solve (search) imports optimizer.store.profiles (store)",
        "optimizer.search.solve (search) imports optimizer.store.profiles.save_points (store)",
    ]
    assert impure_reach(graph) == [
        "optimizer.search.solve reaches duckdb (through optimizer.store.profiles)"
    ]


def test_product_tests_never_import_bench() -> None:
    """The installed product has no ``bench`` package, so a test of the product must not need
    it: ``tests/`` outside ``tests/bench`` imports no ``bench`` module (fixtures live in
    ``tests/``, and the benches import them from there)."""

    def bench_imports(path: Path) -> list[str]:
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [a.name for a in node.names if a.name.split(".")[0] == "bench"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found += [node.module] if node.module.split(".")[0] == "bench" else []
        return found

    tests = ROOT / "tests"
    bad = {
        str(path.relative_to(ROOT)): found
        for path in sorted(tests.rglob("*.py"))
        if (tests / "bench") not in path.parents and (found := bench_imports(path))
    }
    assert bad == {}
