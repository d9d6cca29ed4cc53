"""The import graph follows the layers docs/extending.md (Code layout) describes.

entry points (fedspc_app/*.py) -> fedspc_app/server/, strategies/, clients/ ->
fedspc_app/training/ -> fedspc_app/models/ -> fedspc_app/data/ -> fedspc_app/core/;
fedspc_app/runs/ -> fedspc_app/core/; fedspc_app/experiments/ -> fedspc_app/launch/ ->
fedspc_app/runs/. Nothing imports upwards, strategies/ and clients/ do not import each
other, and no package imports itself in a circle. Both sides of a message meet in
fedspc_app/core/protocol.py and fedspc_app/core/records.py: the client side (the
ClientApp, clients/) imports no strategy, and the server's strategies and the
clients' saved state convert records without torch, the datasets or the models.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> the project packages it may import (besides itself)
CORE, DATA, MODELS, TRAINING, RUNS = (f"fedspc_app.{name}" for name in
                                      ("core", "data", "models", "training", "runs"))
ALLOWED = {
    CORE: set(),
    DATA: {CORE},
    MODELS: {CORE, DATA},
    TRAINING: {CORE, DATA, MODELS},
    RUNS: {CORE},
    "fedspc_app.server": {CORE, DATA, MODELS, TRAINING, RUNS},
    "fedspc_app.launch": {CORE, RUNS},
    "fedspc_app.experiments": {CORE, DATA, MODELS, TRAINING, RUNS, "fedspc_app.launch"},
    "strategies": {CORE},
    "clients": {CORE, DATA, MODELS, TRAINING},
    "fedspc_app": {CORE, DATA, MODELS, TRAINING, RUNS, "fedspc_app.server",
                   "fedspc_app.launch", "strategies", "clients"},
    "deploy": {CORE, RUNS, "fedspc_app.launch", "deploy"},
}
# Packages whose modules load torch (the strategies and the clients' saved state must
# convert records without them).
TORCH_PACKAGES = (DATA, MODELS, TRAINING)
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


def _imports_of(selected):
    return {module: project_imports(path) for module, path in modules() if selected(module)}


def test_the_client_side_imports_no_strategy():
    client_side = _imports_of(lambda m: m in ("fedspc_app.client_app", "fedspc_app.server.deployment")
                              or package_of(m) == "clients")
    assert "fedspc_app.client_app" in client_side and "clients.state" in client_side
    wrong = {module: sorted(name for name in names if package_of(name) == "strategies")
             for module, names in client_side.items()}
    assert not {module: names for module, names in wrong.items() if names}


def test_strategies_and_client_state_do_not_import_the_torch_packages():
    record_users = _imports_of(lambda m: package_of(m) == "strategies" or m == "clients.state")
    assert "strategies.fedspc" in record_users
    wrong = {module: sorted(name for name in names if package_of(name) in TORCH_PACKAGES)
             for module, names in record_users.items()}
    assert not {module: names for module, names in wrong.items() if names}


def test_the_strategies_load_without_torch():
    code = ("import sys, strategies, fedspc_app.core.records, fedspc_app.core.protocol; "
            "print(sorted(m for m in ('torch', 'fedspc_app.models', 'fedspc_app.data') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_module_is_over_700_lines():
    for module, path in modules():
        lines = len(path.read_text().splitlines())
        assert lines <= 700, f"{module}: {lines} lines"
