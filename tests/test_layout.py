"""The import graph follows the layers the README describes.

entry points (fedspc_app/*.py) -> strategies/, clients/ -> fedspc_app/core/;
fedspc_app/experiments/ -> fedspc_app/launch/ -> fedspc_app/core/. Nothing imports
upwards, strategies/ and clients/ do not import each other, and no package imports
itself in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> the project packages it may import (besides itself)
ALLOWED = {
    "fedspc_app.core": set(),
    "fedspc_app.launch": {"fedspc_app.core"},
    "fedspc_app.experiments": {"fedspc_app.core", "fedspc_app.launch"},
    "strategies": {"fedspc_app.core"},
    "clients": {"fedspc_app.core"},
    "fedspc_app": {"fedspc_app.core", "fedspc_app.launch", "strategies", "clients"},
    "deploy": {"fedspc_app.core", "fedspc_app.launch", "deploy"},
}
PACKAGES = sorted(ALLOWED, key=len, reverse=True)


def package_of(module: str) -> str | None:
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), None)


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if package_of(name) is not None}


def modules():
    for folder in ("fedspc_app", "strategies", "clients", "deploy"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield name.removesuffix(".__init__"), path


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda v: str(v))
def test_imports_follow_the_layers(module, path):
    own = package_of(module)
    wrong = sorted(name for name in project_imports(path)
                   if package_of(name) != own and package_of(name) not in ALLOWED[own])
    assert not wrong, f"{module} ({own}) imports {wrong}"


def test_no_module_imports_in_a_circle():
    graph: dict[str, set[str]] = {}
    names = dict(modules())
    for module, path in names.items():
        graph[module] = {name for name in project_imports(path) if name in names}

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            raise AssertionError(" -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        for target in graph[node]:
            visit(target, stack + [node], done)
        done.add(node)

    done: set[str] = set()
    for module in graph:
        visit(module, [], done)
