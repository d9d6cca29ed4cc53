"""What a run records of the code, software and machine that made it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fedspc_app.runs import provenance
from fedspc_app.runs.provenance import (
    ORIGIN_ENV,
    code_changes,
    code_id,
    describe_code,
    git_origin,
    run_code_ids,
    run_segments,
    source_hash,
)


def make_tree(root: Path) -> Path:
    for package in provenance.PACKAGES:
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text(f"NAME = {package!r}\n")
    return root


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def commit_all(root: Path) -> str:
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    return git(root, "rev-parse", "HEAD")


def test_the_source_hash_follows_the_python_source_and_nothing_else(tmp_path):
    root = make_tree(tmp_path)
    first = source_hash(root)
    assert first == source_hash(root) and len(first) == 64
    (root / "clients" / "notes.md").write_text("not code")
    (root / "clients" / "__pycache__").mkdir()
    (root / "clients" / "__pycache__" / "x.py").write_text("cached")
    assert source_hash(root) == first
    (root / "strategies" / "__init__.py").write_text("NAME = 'changed'\n")
    assert source_hash(root) != first
    # A file moved to another name is another source, even with the same bytes.
    (root / "strategies" / "__init__.py").write_text("NAME = 'strategies'\n")
    assert source_hash(root) == first
    (root / "strategies" / "__init__.py").rename(root / "strategies" / "other.py")
    assert source_hash(root) != first


def test_the_checkout_gives_its_commit_and_whether_the_apps_files_changed(tmp_path):
    root = make_tree(tmp_path / "repo")
    (root / "pyproject.toml").write_text("[tool.flwr.app.config]\nseed = 0\n")
    (root / "docs").mkdir()
    (root / "docs" / "results.md").write_text("committed results\n")
    assert git_origin(root) is None  # not a checkout yet
    commit = commit_all(root)
    assert git_origin(root) == {"git-commit": commit, "dirty": False}
    (root / "results.json").write_text("{}")  # untracked output: still clean
    # Committed results or documentation edited in the checkout (as when a grid's
    # worktree receives its finished runs) are not the app: still clean.
    (root / "docs" / "results.md").write_text("a newer table\n")
    assert git_origin(root) == {"git-commit": commit, "dirty": False}
    (root / "pyproject.toml").write_text("[tool.flwr.app.config]\nseed = 1\n")
    assert git_origin(root) == {"git-commit": commit, "dirty": True}
    git(root, "checkout", "-q", "pyproject.toml")
    (root / "clients" / "__init__.py").write_text("EDITED = 1\n")
    assert git_origin(root) == {"git-commit": commit, "dirty": True}
    # Packages inside a larger repository are not that repository's checkout.
    assert git_origin(root / "clients") is None


def test_an_installed_app_takes_its_checkout_from_the_launcher(monkeypatch):
    provenance.code_version.cache_clear()
    monkeypatch.setattr(provenance, "git_origin", lambda root=None: None)
    monkeypatch.setenv(ORIGIN_ENV, json.dumps({"git-commit": "ab" * 20, "dirty": False}))
    code = provenance.code_version()
    provenance.code_version.cache_clear()
    assert code["git-commit"] == "ab" * 20 and code["dirty"] is False
    assert code["origin"] == "launcher" and code["source-sha256"] == source_hash()
    assert describe_code(code) == f"git abababab, source {code['source-sha256'][:8]}"
    monkeypatch.setenv(ORIGIN_ENV, "not json")  # ignored, not fatal
    code = provenance.code_version()
    provenance.code_version.cache_clear()
    assert "git-commit" not in code and code["package-version"]
    assert describe_code(code).startswith("fedspc ")


def segment(first: int, source: str | None) -> dict:
    return {"first-round": first, "code": {"source-sha256": source} if source else None}


def test_segments_keep_the_starts_up_to_the_resumed_round():
    previous = [segment(1, "a"), segment(4, "b"), segment(8, "c")]
    # Resumed after round 5: the segment from round 8 never reached its checkpoint.
    kept = run_segments(previous, 5, segment(6, "b"))
    assert [s["first-round"] for s in kept] == [1, 4, 6]
    assert code_changes(kept) == [4]
    assert run_segments(previous, 0, segment(1, "d")) == [segment(1, "d")]  # a new run
    # A run that recorded no segments before: its earlier rounds' code is unknown.
    kept = run_segments(None, 3, segment(4, "a"))
    assert [s["first-round"] for s in kept] == [1, 4] and kept[0]["code"] is None
    assert code_changes(kept) == [4]


def test_a_runs_code_ids_come_from_its_segments_or_its_code():
    assert run_code_ids({"segments": [segment(1, "a"), segment(3, "b")]}) == ["a", "b"]
    assert run_code_ids({"code": {"source-sha256": "a"}}) == ["a"]
    assert run_code_ids({}) == [None] and run_code_ids(None) == [None]
    assert code_id({"source-sha256": 3}) is None and describe_code(None) == "unrecorded"


@pytest.mark.parametrize("same_code", [True, False])
def test_provenance_of_a_resumed_run_appends_a_segment(monkeypatch, same_code):
    codes = iter([{"source-sha256": "a"}, {"source-sha256": "a" if same_code else "b"}])
    monkeypatch.setattr(provenance, "code_version", lambda: next(codes))
    first, warning = provenance.provenance(None, 0, "cpu")
    assert warning is None and [s["first-round"] for s in first["segments"]] == [1]
    assert first["machine"]["cpu"] and first["software"]["torch"]
    second, warning = provenance.provenance(first, 3, "cpu")
    assert [s["first-round"] for s in second["segments"]] == [1, 4]
    assert second["code"] == second["segments"][-1]["code"]
    assert (warning is None) == same_code
    if not same_code:
        assert "resumes after round 3 under other code" in warning
