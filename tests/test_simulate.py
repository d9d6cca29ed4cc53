"""Process hygiene of the simulation helpers (fedspc_app.simulate)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedspc_app.simulate import exit_on_termination

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import signal, subprocess, sys, time
    from fedspc_app.simulate import exit_on_termination

    # the dispositions a plain shell gives, whatever this test was started with
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[2] == "nohup" else signal.SIG_DFL)

    def work():
        # stands in for the SuperLink: its own session, so the signal misses it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True, stdout=subprocess.DEVNULL)
        try:
            print(child.pid, flush=True)  # inside try: the signal comes after this line
            time.sleep(600)
        finally:
            child.kill()
            child.wait()
            print("stopped the child", flush=True)

    if sys.argv[1] == "guarded":
        with exit_on_termination():
            work()
    else:
        work()
""")


def _start(tmp_path: Path, mode: str, hup: str = "default") -> tuple[subprocess.Popen, int]:
    """The child script running (``guarded`` or ``bare``) and its detached grandchild's PID."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    process = subprocess.Popen([sys.executable, str(script), mode, hup], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _terminate(tmp_path: Path, mode: str, sig: int) -> tuple[int, str, int]:
    process, child = _start(tmp_path, mode)
    process.send_signal(sig)
    out, _ = process.communicate(timeout=60)
    return process.returncode, out, child


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_termination_signals_run_cleanup_that_stops_detached_processes(tmp_path, sig):
    code, out, child = _terminate(tmp_path, "guarded", sig)
    assert code == 128 + sig
    assert "stopped the child" in out
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_without_the_guard_sigterm_skips_cleanup(tmp_path):
    # Why the guard exists: Python's default SIGTERM ends the process at once.
    code, out, child = _terminate(tmp_path, "bare", signal.SIGTERM)
    try:
        assert code == -signal.SIGTERM
        assert "stopped the child" not in out
        os.kill(child, 0)  # still alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_an_ignored_sighup_stays_ignored(tmp_path):
    # Started under nohup: SIGHUP must not end the run; SIGTERM still cleans up.
    process, child = _start(tmp_path, "guarded", "nohup")
    process.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=2)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM and "stopped the child" in out
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_handlers_are_restored_after_the_block():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    with exit_on_termination():
        assert signal.getsignal(signal.SIGTERM) not in before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before
