"""Atomic writes and folder locks (fedspc_app.core.files)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedspc_app.core.errors import BusyError, FedSPCError
from fedspc_app.core.files import (
    atomic_write,
    file_lock,
    folder_lock,
    lock_holder,
    lock_path,
)


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


# ------------------------------------------------------------------ folder locks
def test_a_locked_folder_refuses_a_second_holder_and_names_the_first(tmp_path):
    folder = tmp_path / "runs" / "a"
    assert lock_holder(folder) is None  # never locked
    with folder_lock(folder, "run 'a'"):
        assert not folder.exists()  # the lock lives beside the folder, which it leaves alone
        assert lock_path(folder) == tmp_path / "runs" / ".fedspc-a.lock"
        holder = lock_holder(folder)
        assert holder["what"] == "run 'a'" and holder["pid"] == os.getpid()
        with pytest.raises(BusyError, match=rf"runs/a is in use by run 'a' \(pid {os.getpid()} "), \
                folder_lock(folder, "run 'a' again", pause=0.01):
            pass  # pragma: no cover - not reached
        assert lock_holder(folder)["what"] == "run 'a'"  # the refused one erased nothing
        with folder_lock(tmp_path / "runs" / "b", "run 'b'"):  # another folder is free
            pass
    assert lock_holder(folder) is None
    # Released, the file keeps no holder: its start time would time a private run.
    assert lock_path(folder).read_bytes() == b""
    with folder_lock(folder, "run 'a', later"):  # released: the next run takes it
        assert lock_holder(folder)["what"] == "run 'a', later"


def test_a_killed_holder_leaves_its_folder_free(tmp_path):
    folder = tmp_path / "a"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         ("import sys, time\n"
          "from fedspc_app.core.files import folder_lock\n"
          f"with folder_lock({str(folder)!r}, 'a child'):\n"
          "    print('held', flush=True)\n"
          "    time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_holder(folder)["pid"] == holder.pid
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs
        holder.wait()
    assert lock_holder(folder) is None
    with folder_lock(folder, "after the kill"):
        pass


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_filesystem_without_flock_is_one_error_naming_the_lock_and_the_fix(
        tmp_path, monkeypatch, code):
    """NFS without its lock service (ENOLCK), Lustre without -o flock (ENOSYS), some
    FUSE or SMB mounts (EOPNOTSUPP): not a bare OSError on every round."""
    def no_locks(fd, flags):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr("fedspc_app.core.files.fcntl.flock", no_locks)
    lock = tmp_path / ".partition-0.lock"
    with pytest.raises(FedSPCError, match="does not support flock") as raised, \
            file_lock(lock):
        pass
    assert str(lock) in str(raised.value) and "local state-dir" in str(raised.value)
    with pytest.raises(FedSPCError, match="does not support flock"), \
            folder_lock(tmp_path / "run", "a run"):
        pass


@pytest.mark.parametrize("planted", ["symlink", "folder"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_nothing_followed(
        tmp_path, planted):
    """Someone who can write the folder plants the lock as a symlink (the lock would
    create a file where it points) or as a folder: one clear error instead."""
    lock, target = tmp_path / ".partition-0.lock", tmp_path / "elsewhere"
    if planted == "symlink":
        lock.symlink_to(target)
    else:
        lock.mkdir()
    with pytest.raises(FedSPCError, match="is not a regular file"), file_lock(lock):
        pass
    assert not target.exists()
