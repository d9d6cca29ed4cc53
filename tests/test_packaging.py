"""What `flwr run` uploads: the FAB built from this project."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedspc_app", "strategies", "clients")


def test_fab_holds_exactly_the_app_packages():
    names = set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist())
    modules = {path.relative_to(ROOT).as_posix()
               for package in PACKAGES for path in (ROOT / package).rglob("*.py")
               if "__pycache__" not in path.parts}
    assert modules and modules <= names
    # Results, tests, scripts and docs stay out of it, so committed results never
    # count against Flower's 10 MB FAB limit.
    assert names - modules == {"pyproject.toml", ".info/CONTENT"}
