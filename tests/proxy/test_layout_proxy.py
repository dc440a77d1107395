"""The proxy package's shape: imports at module level only, no import cycle among its modules,
one route table per handler module, and the OpenAI error shape written in one function."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

from aiohttp import web

from proxy import admin, app, forward, health, models

PACKAGE = Path(__file__).resolve().parents[2] / "proxy"


def _trees() -> dict[str, ast.Module]:
    return {
        f"proxy.{path.stem}": ast.parse(path.read_text(), str(path))
        for path in sorted(PACKAGE.glob("*.py"))
        if path.stem != "__init__"
    }


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_import_inside_a_function() -> None:
    lazy = [
        f"{name}:{node.lineno}"
        for name, tree in _trees().items()
        for fn in _functions(tree)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    assert lazy == []


def _proxy_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The proxy modules ``tree`` imports (``from proxy import x`` names module x)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module == "proxy":
            found |= {f"proxy.{a.name}" for a in node.names} & modules
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            found.add(node.module)
    return found


def test_proxy_modules_import_each_other_without_a_cycle() -> None:
    trees = _trees()
    graph = {name: _proxy_imports(tree, set(trees)) for name, tree in trees.items()}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # CycleError on a cycle
    assert order.index("proxy.keys") < order.index("proxy.forward") < order.index("proxy.app")
    assert "proxy.app" not in set().union(*(graph[m] for m in graph if m != "proxy.cli"))


def test_each_handler_module_owns_its_route_table() -> None:
    for module in (health, models, admin, forward):
        assert isinstance(module.routes, web.RouteTableDef) and len(module.routes) > 0
    tables = {module.__name__ for module in (health, models, admin, forward)}
    assert _proxy_imports(ast.parse(Path(app.__file__).read_text()), tables) == tables


def test_the_openai_error_shape_is_written_once() -> None:
    """Only ``proxy.errors.error_body`` builds a ``{"error": ...}`` document; only
    ``proxy.boundary.error_response`` turns an error into a response."""
    writers = [
        f"{name}.{fn.name}"
        for name, tree in _trees().items()
        for fn in _functions(tree)
        for node in ast.walk(fn)
        if isinstance(node, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "error" for k in node.keys)
    ]
    assert writers == ["proxy.errors.error_body"]
    body_users = [
        f"{name}.{fn.name}"
        for name, tree in _trees().items()
        for fn in _functions(tree)
        for node in ast.walk(fn)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "body"
        and not node.args
    ]
    assert body_users == ["proxy.boundary.error_response"]
