"""Run the app in Flower's Ray simulation with a private SuperLink that is always stopped.

``flwr run .`` on the ``local`` connection starts a detached SuperLink that keeps
running (with the environment it was started with) after the run. For scripted
runs (tests, benchmarks, experiment grids) this module starts its own SuperLink
on a free port, with runtime dependency installation off and its own
``FLWR_HOME``, submits the run with ``flwr run --stream``, and stops the SuperLink
(and the simulation processes under it) by PID when done::

    python -m fedspc_app.simulate --run-config conf/cpu-cifar100-cnn.toml \\
        --clients 10 --client-cpus 1 --set "num-rounds=3"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from fedspc_app.errors import FedSPCError

APP_DIR = Path(__file__).resolve().parent.parent
CONNECTION = "fedspc-sim"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def simulation_env(flwr_home: Path) -> dict[str, str]:
    """Environment for the SuperLink and ``flwr``: private home, no runtime installs."""
    env = os.environ.copy()
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _bin(name: str) -> str:
    """A console script of this environment (next to the running interpreter)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


class LocalSuperLink:
    """A SuperLink in simulation mode on a free loopback port, owned by this process."""

    def __init__(self, flwr_home: Path, *, log_file: Path | None = None,
                 startup_timeout: float = 60.0) -> None:
        self.flwr_home = Path(flwr_home)
        self.log_file = log_file or self.flwr_home / "superlink.log"
        self.startup_timeout = startup_timeout
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "LocalSuperLink":
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = {"superlink": {"default": CONNECTION,
                                CONNECTION: {"address": self.address, "insecure": True}}}
        (self.flwr_home / "config.toml").write_text(tomli_w.dumps(config))
        command = [
            _bin("flower-superlink"), "--insecure", "--simulation",
            "--isolation", "subprocess",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        log = open(self.log_file, "ab")  # noqa: SIM115 - owned by the process
        self.process = subprocess.Popen(
            command, env=simulation_env(self.flwr_home), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends Ray with it
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"flower-superlink exited with code {self.process.returncode}; "
                    f"see {self.log_file}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=1):
                    return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"flower-superlink did not start within {self.startup_timeout:.0f} s;"
                           f" see {self.log_file}")

    def stop(self, timeout: float = 20.0) -> None:
        """Terminate the SuperLink's whole process group (SIGTERM, then SIGKILL)."""
        if self.process is None:
            return
        pgid = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.process = None

    def __enter__(self) -> "LocalSuperLink":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def federation_config(clients: int, client_cpus: float, client_gpus: float) -> str:
    return (f"num-supernodes={clients} client-resources-num-cpus={client_cpus:g} "
            f"client-resources-num-gpus={client_gpus:g}")


def flwr_run(superlink: LocalSuperLink, run_config: Mapping[str, Any], *, clients: int,
             client_cpus: float = 1.0, client_gpus: float = 0.0, app_dir: Path = APP_DIR,
             log_file: Path | None = None, timeout: float | None = None,
             echo: bool = False) -> int:
    """Submit one run with ``flwr run --stream`` and wait for it; return its exit code.

    The run's output goes to ``log_file`` (and to stdout when ``echo``).
    """
    with tempfile.NamedTemporaryFile("wb", suffix=".toml", delete=False) as handle:
        handle.write(tomli_w.dumps(dict(run_config)).encode())
        config_path = handle.name
    command = [
        _bin("flwr"), "run", str(app_dir), CONNECTION, "--stream",
        "--run-config", config_path,
        "--federation-config", federation_config(clients, client_cpus, client_gpus),
    ]
    try:
        with contextlib.ExitStack() as stack:
            sink = stack.enter_context(open(log_file, "ab")) if log_file else None
            process = subprocess.Popen(command, env=simulation_env(superlink.flwr_home),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            # A timer, not a check per output line: a run can hang without printing.
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
                if process.poll() is None:  # interrupted: do not leave flwr run behind
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            if expired.is_set():
                raise TimeoutError(f"flwr run exceeded {timeout:.0f} s")
            return code
    finally:
        os.unlink(config_path)


class SimulationFailed(RuntimeError):
    """A submitted run ended without writing a complete summary."""


def app_defaults(app_dir: Path = APP_DIR) -> dict[str, Any]:
    """The app's run-config defaults (``[tool.flwr.app.config]`` of pyproject.toml)."""
    return dict(read_toml(Path(app_dir) / "pyproject.toml")["tool"]["flwr"]["app"]["config"])


def absolute_paths(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Make ``output-dir`` and ``data-dir`` absolute (relative to this process's cwd).

    The ServerApp and ClientApps resolve relative paths against their own working
    directory, which is the SuperLink's, not the caller's.
    """
    out = dict(run_config)
    for key in ("output-dir", "data-dir"):
        if out.get(key):
            out[key] = str(Path(str(out[key])).expanduser().resolve())
    return out


def submit_and_check(run_config: Mapping[str, Any], submit: Callable[[dict], int], *,
                     app_dir: Path = APP_DIR, log_file: Path | None = None) -> dict[str, Any]:
    """Validate ``run_config``, hand the merged config to ``submit``, return the summary.

    ``submit(run_config) -> exit code`` starts the run (``flwr run`` on some
    connection) and waits for it. The config is checked here first, so a typo fails
    at once. ``flwr run`` exits 0 even when the ServerApp fails, so success is
    judged by a complete ``summary.json`` written by this run.
    """
    from fedspc_app.config import parse_run_config

    overrides = absolute_paths(run_config)
    defaults = absolute_paths({"output-dir": "results", **app_defaults(app_dir)})
    merged = {**defaults, **overrides}
    config = parse_run_config(merged)
    summary_path = config.run_dir / "summary.json"
    started = time.time()
    code = submit(merged)
    if code != 0 or not summary_path.exists() or summary_path.stat().st_mtime < started:
        where = f"; see {log_file}" if log_file else ""
        raise SimulationFailed(f"run {config.resolved_run_name!r} did not complete "
                               f"(flwr exit code {code}){where}")
    summary = json.loads(summary_path.read_text())
    if not summary.get("complete"):
        raise SimulationFailed(f"run {config.resolved_run_name!r} stopped early: {summary}")
    return summary


def run_simulation(run_config: Mapping[str, Any], *, superlink: LocalSuperLink,
                   clients: int, client_cpus: float = 1.0, client_gpus: float = 0.0,
                   app_dir: Path = APP_DIR, log_file: Path | None = None,
                   timeout: float | None = None, echo: bool = False) -> dict[str, Any]:
    """Validate, submit and wait for one simulated run; return its ``summary.json``."""
    return submit_and_check(
        run_config,
        lambda merged: flwr_run(superlink, merged, clients=clients, client_cpus=client_cpus,
                                client_gpus=client_gpus, app_dir=app_dir, log_file=log_file,
                                timeout=timeout, echo=echo),
        app_dir=app_dir, log_file=log_file)


@contextlib.contextmanager
def simulation(flwr_home: Path | None = None) -> Iterator[LocalSuperLink]:
    """A started :class:`LocalSuperLink` in a (temporary) FLWR_HOME, stopped on exit."""
    with contextlib.ExitStack() as stack:
        home = Path(flwr_home) if flwr_home else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="fedspc-flwr-")))
        with LocalSuperLink(home) as superlink:
            yield superlink


def read_toml(path: str | Path) -> dict[str, Any]:
    import tomllib

    with open(path, "rb") as handle:
        return tomllib.load(handle)


def parse_assignments(text: str) -> dict[str, Any]:
    """``"a=1 b='x'"`` → ``{"a": 1, "b": "x"}`` (values are TOML), as ``flwr run`` reads them."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text])) if text.strip() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", help="TOML file of run-config overrides (conf/*.toml)")
    parser.add_argument("--set", default="", help='extra overrides, e.g. "num-rounds=3 fedspc=true"')
    parser.add_argument("--clients", type=int, default=10, help="simulated SuperNodes (K)")
    parser.add_argument("--client-cpus", type=float, default=1.0)
    parser.add_argument("--client-gpus", type=float, default=0.0,
                        help="GPU fraction per client, e.g. 0.25 runs 4 clients per GPU")
    parser.add_argument("--flwr-home", help="keep the SuperLink's FLWR_HOME here")
    parser.add_argument("--log", help="also write the run's output to this file")
    args = parser.parse_args(argv)
    run_config = read_toml(args.run_config) if args.run_config else {}
    run_config.update(parse_assignments(args.set))
    try:
        with exit_on_termination(), \
                simulation(Path(args.flwr_home) if args.flwr_home else None) as superlink:
            run_simulation(run_config, superlink=superlink, clients=args.clients,
                           client_cpus=args.client_cpus, client_gpus=args.client_gpus,
                           log_file=Path(args.log) if args.log else None, echo=True)
    except (FedSPCError, SimulationFailed) as error:
        print(f"fedspc: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
