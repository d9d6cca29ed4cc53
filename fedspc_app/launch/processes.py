"""Child processes owned by the caller: environment, logging, timeouts, stopping.

Every child starts in a session of its own and is stopped together with what it
started (:func:`stop_tree`), by PID, never by name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from fedspc_app.core.errors import FedSPCError

TAIL_LINES = 30  # log lines quoted in a launch error


class LaunchFailed(FedSPCError, RuntimeError):
    """A launched process exited early or never became ready (the message quotes its log)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def console_script(name: str) -> str:
    """A console script of this environment (next to the running interpreter)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with the running interpreter's bin folder
    first on PATH: Flower's processes start others (``flower-superexec``) by name; and
    this machine's loopback in ``no_proxy``: gRPC sends even a call to 127.0.0.1
    through ``$http_proxy``/``$https_proxy``, which cannot reach it."""
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        env["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir
    for key in ("no_proxy", "NO_PROXY"):
        hosts = [host for host in env.get(key, "").split(",") if host.strip()]
        env[key] = ",".join(hosts + [host for host in LOOPBACK if host not in hosts])
    return env


def log_tail(log_file: str | os.PathLike[str], lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``log_file`` ("" when it does not exist)."""
    try:
        text = Path(log_file).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def launch_failed(message: str, log_file: str | os.PathLike[str]) -> LaunchFailed:
    """``message`` and the tail of ``log_file``, which may be deleted soon after."""
    tail = log_tail(log_file)
    quoted = f"; last lines of {log_file}:\n{tail}" if tail else f"; see {log_file}"
    return LaunchFailed(message + quoted)


@contextlib.contextmanager
def exit_on_termination() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``SystemExit`` while the block runs.

    Launched processes run in sessions of their own, which a signal to the caller's
    process group misses; Python's default action for these signals skips
    ``finally`` blocks, so without this they would keep running. An ignored signal
    (``nohup``) stays ignored; outside the main thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ------------------------------------------------------------------ process trees
def _process_table() -> dict[int, tuple[int, int, str]]:
    """``pid -> (parent pid, session id, start time)`` of every living process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields:
                table[int(entry.name)] = (int(fields[1]), int(fields[3]), fields[19])
    return table


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat``; None once the process has exited (or is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields


def start_time(pid: int) -> str | None:
    """The kernel's start time of a living ``pid``: with the PID, it names one process."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def _add_descendants(found: dict[int, str], table: Mapping[int, tuple[int, int, str]]) -> None:
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = [pid for pid, started in found.items() if pid in table and table[pid][2] == started]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = table[child][2]
                todo.append(child)


def owned_processes(pid: int, *, with_root: bool = True) -> dict[int, str]:
    """``pid`` (unless ``with_root=False``: it exited, its number may be reused), the
    members of its session (orphans) and all their living descendants (those in new
    sessions: Flower's SuperExec, Ray), with their start times."""
    table = _process_table()
    found = {member: started for member, (_, session, started) in table.items()
             if session == pid and member != pid}
    if with_root and pid in table:
        found[pid] = table[pid][2]
    _add_descendants(found, table)
    return found


def _signal_all(tree: Mapping[int, str], sig: int) -> None:
    for pid, started in tree.items():
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def stop_tree(process: subprocess.Popen, started_at: str | None, *,
              timeout: float = 20.0) -> int | None:
    """Stop ``process`` (started at ``started_at``) with everything :func:`owned_processes`
    lists: SIGTERM, up to ``timeout`` s for it (5 s for the others) to exit, then SIGKILL
    to what is left, including processes started meanwhile. ``timeout=0`` kills at once.
    Returns the exit code."""
    root = process.pid
    tree = owned_processes(root, with_root=start_time(root) == started_at)
    if timeout > 0:
        _signal_all(tree, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
                start_time(pid) == started for pid, started in tree.items() if pid != root):
            time.sleep(0.2)
        tree.update(owned_processes(root, with_root=process.poll() is None))
        _add_descendants(tree, _process_table())
    _signal_all(tree, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
    return process.returncode


class OwnedProcess:
    """A command started in a new session, logging to a file, stopped with :func:`stop_tree`.

    ``env`` is the full environment; the interpreter's bin folder goes first on its
    PATH (:func:`child_env`).
    """

    def __init__(self, command: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str],
                 log_file: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None
                 ) -> None:
        self.command = [str(part) for part in command]
        self.env = child_env(env)
        self.log_file = Path(log_file)
        self.cwd = cwd
        self.process: subprocess.Popen | None = None
        self.started_at: str | None = None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("not started")
        return self.process.pid

    def start(self) -> OwnedProcess:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                self.command, env=self.env, cwd=self.cwd, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_at = start_time(self.process.pid)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def wait_for_log(self, text: str, timeout: float, *, after: int = 0) -> bool:
        """Whether ``text`` appears in the log (past character ``after``) within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log_text()[after:]:
                return True
            if not self.alive():
                return text in self.log_text()[after:]
            time.sleep(0.3)
        return False

    def stop(self, timeout: float = 20.0) -> int | None:
        """:func:`stop_tree`; the exit code (None if it was not running)."""
        if self.process is None:
            return None
        code = stop_tree(self.process, self.started_at, timeout=timeout)
        self.process = None
        return code

    def __enter__(self) -> OwnedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_logged(command: Sequence[str], *, env: Mapping[str, str], log_file: Path | None = None,
               timeout: float | None = None, echo: bool = False, what: str = "command") -> int:
    """Run ``command`` in a new session, copy its output to ``log_file`` (and stdout
    when ``echo``), return its exit code.

    A timer enforces ``timeout`` (a child can hang without printing). On a timeout
    or an interruption the command is killed with :func:`stop_tree`; a timeout then
    raises ``TimeoutError``.
    """
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(log_file, "ab")) if log_file else None
        process = subprocess.Popen(list(command), env=child_env(env), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        started_at = start_time(process.pid)
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            stop_tree(process, started_at, timeout=0)

        timer = threading.Timer(timeout, kill) if timeout is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if sink:
                    sink.write(line)
                    sink.flush()
                if echo:
                    sys.stdout.write(line.decode(errors="replace"))
                    sys.stdout.flush()
            code = process.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if process.poll() is None:  # interrupted: do not leave the command behind
                stop_tree(process, started_at, timeout=0)
        if expired.is_set():
            raise TimeoutError(f"{what} exceeded {timeout:.0f} s")
        return code
