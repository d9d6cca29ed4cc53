"""Atomic writes (fedspc_app.core.files)."""

from __future__ import annotations

import os

import pytest

from fedspc_app.core.files import atomic_write


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_atomic_write_gives_the_file_the_mode_open_would(tmp_path, mask):
    previous = os.umask(mask)
    try:
        atomic_write(tmp_path / "a.json", "{}")
    finally:
        os.umask(previous)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "a.json").read_text() == "{}"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    atomic_write(tmp_path / "a.txt", "old")
    with pytest.raises(TypeError):
        atomic_write(tmp_path / "a.txt", 3)  # not bytes or text
    assert (tmp_path / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
