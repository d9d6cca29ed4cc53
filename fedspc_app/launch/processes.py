"""Child processes owned by the caller: environment, logging, timeouts, stopping."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def console_script(name: str) -> str:
    """A console script of this environment (next to the running interpreter)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


@contextlib.contextmanager
def exit_on_termination() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``SystemExit`` while the block runs.

    The local SuperLink, Ray and ``flwr run`` run in their own sessions, so a
    signal sent to the caller's process group (a job scheduler's SIGTERM, a closed
    terminal's SIGHUP) does not reach them. Python's default action for these
    signals ends the process without running ``finally`` blocks, which would leave
    them running; as ``SystemExit`` the context managers stop them. A signal that
    is ignored (``nohup``) stays ignored; outside the main thread (where handlers
    cannot be set) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    # A signal the process was started to ignore (nohup's SIGHUP) stays ignored.
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _kill_group(pid: int, expired: threading.Event) -> None:
    expired.set()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_logged(command: Sequence[str], *, env: Mapping[str, str], log_file: Path | None = None,
               timeout: float | None = None, echo: bool = False, what: str = "command") -> int:
    """Run ``command`` in a new session, copy its output to ``log_file`` (and stdout
    when ``echo``), return its exit code.

    A timer, not a check per output line, enforces ``timeout``: a child can hang
    without printing. On a timeout or an interruption the child's process group is
    killed; a timeout then raises ``TimeoutError``.
    """
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(log_file, "ab")) if log_file else None
        process = subprocess.Popen(list(command), env=dict(env), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        timer, expired = None, threading.Event()
        if timeout is not None:
            timer = threading.Timer(timeout, _kill_group, (process.pid, expired))
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
            if process.poll() is None:  # interrupted: do not leave the child behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if expired.is_set():
            raise TimeoutError(f"{what} exceeded {timeout:.0f} s")
        return code
