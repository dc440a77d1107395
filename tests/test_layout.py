"""DESIGN §2: which package may import which. Read from the source, so a violation anywhere
(even inside a function) fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"proxy", "optimizer", "shared", "sim", "examples", "bench"}
ALLOWED = {
    "proxy": {"proxy", "shared"},
    "optimizer": {"optimizer", "shared"},
    "shared": {"shared"},
    "sim": {"sim", "shared"},
    "examples": {"examples"},
}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & OURS


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_design_allows(package: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(_imports(path) - ALLOWED[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}
