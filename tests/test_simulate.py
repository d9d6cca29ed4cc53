"""Process hygiene of the launch helpers (fedspc_app.launch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedspc_app.launch import superlink as simulate
from fedspc_app.launch.processes import exit_on_termination

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import signal, subprocess, sys, time
    from fedspc_app.launch.processes import exit_on_termination

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
    process = _python(tmp_path, CHILD, mode, hup)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _python(tmp_path: Path, source: str, *args: str) -> subprocess.Popen:
    """``source`` run as a script of its own, importing this checkout, stdout piped."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


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


# --- flwr_run against a stand-in ``flwr`` console script ----------------------------

FAKE_FLWR = textwrap.dedent("""
    import os, subprocess, sys, time, tomllib
    config_path = sys.argv[sys.argv.index("--run-config") + 1]
    with open(config_path, "rb") as handle:
        mode = tomllib.load(handle)["mode"]
    print("config", config_path, flush=True)
    print("home", os.environ["FLWR_HOME"], os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"],
          flush=True)
    if mode == "exit":
        sys.exit(3)
    # like flwr run --stream: a child in the same process group, then wait for the run
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("pids", os.getpid(), child.pid, flush=True)
    time.sleep(600)
""")


def _fake_flwr(tmp_path: Path) -> Path:
    (tmp_path / "fake_flwr.py").write_text(FAKE_FLWR)
    script = tmp_path / "flwr"  # a shell wrapper: no limit on the interpreter path's length
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake_flwr.py"}" "$@"\n')
    script.chmod(0o755)
    return script


def _gone(pid: int, within: float = 10.0) -> bool:
    """True once ``pid`` has exited (a zombie left for an init that never reaps counts)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _pids(log: Path) -> list[int]:
    for line in log.read_text().splitlines():
        if line.startswith("pids "):
            return [int(pid) for pid in line.split()[1:]]
    raise AssertionError(f"no pids line in {log.read_text()!r}")


def test_flwr_run_returns_the_exit_code_logs_output_and_removes_its_config(tmp_path, monkeypatch):
    monkeypatch.setattr(simulate, "console_script", lambda name: str(_fake_flwr(tmp_path)))
    superlink = SimpleNamespace(flwr_home=tmp_path / "home")
    log = tmp_path / "run.log"
    code = simulate.flwr_run(superlink, {"mode": "exit"}, clients=2, log_file=log)
    assert code == 3
    lines = dict(line.split(" ", 1) for line in log.read_text().splitlines())
    assert lines["home"] == f"{tmp_path / 'home'} 1"  # private FLWR_HOME, no runtime installs
    assert not Path(lines["config"]).exists()


def test_flwr_run_timeout_kills_the_whole_run_group(tmp_path, monkeypatch):
    monkeypatch.setattr(simulate, "console_script", lambda name: str(_fake_flwr(tmp_path)))
    log = tmp_path / "run.log"
    with pytest.raises(TimeoutError, match="exceeded 2 s"):
        simulate.flwr_run(SimpleNamespace(flwr_home=tmp_path), {"mode": "hang"}, clients=2,
                          log_file=log, timeout=2)
    assert all(_gone(pid) for pid in _pids(log))


INTERRUPTED = textwrap.dedent("""
    import sys
    from pathlib import Path
    from types import SimpleNamespace
    from fedspc_app.launch import superlink as simulate

    simulate.console_script = lambda name: sys.argv[1]
    with simulate.exit_on_termination():
        simulate.flwr_run(SimpleNamespace(flwr_home=Path(sys.argv[2])), {"mode": "hang"},
                          clients=2, echo=True)
""")


def test_an_interrupted_flwr_run_is_killed_with_its_children(tmp_path):
    process = _python(tmp_path, INTERRUPTED, str(_fake_flwr(tmp_path)), str(tmp_path))
    assert process.stdout is not None
    line = ""
    while not line.startswith("pids "):
        line = process.stdout.readline()
        assert line, "the stand-in flwr printed no pids"
    pids = [int(pid) for pid in line.split()[1:]]
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert all(_gone(pid) for pid in pids)
