"""A private SuperLink in simulation mode, and runs submitted to it with ``flwr run``.

``flwr run .`` on the ``local`` connection starts a detached SuperLink that keeps
running (with the environment it was started with) after the run. Scripted runs
(tests, benchmarks, experiment grids) use :class:`LocalSuperLink` instead: a free
port, runtime dependency installation off, its own ``FLWR_HOME``, stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from fedspc_app.core.config import parse_run_config
from fedspc_app.launch.processes import console_script, free_port, run_logged
from fedspc_app.launch.runconfig import APP_DIR, absolute_paths, app_defaults

CONNECTION = "fedspc-sim"


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
            console_script("flower-superlink"), "--insecure", "--simulation",
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
        console_script("flwr"), "run", str(app_dir), CONNECTION, "--stream",
        "--run-config", config_path,
        "--federation-config", federation_config(clients, client_cpus, client_gpus),
    ]
    try:
        return run_logged(command, env=simulation_env(superlink.flwr_home), log_file=log_file,
                          timeout=timeout, echo=echo, what="flwr run")
    finally:
        os.unlink(config_path)


class SimulationFailed(RuntimeError):
    """A submitted run ended without writing a complete summary."""


def submit_and_check(run_config: Mapping[str, Any], submit: Callable[[dict], int], *,
                     app_dir: Path = APP_DIR, log_file: Path | None = None) -> dict[str, Any]:
    """Validate ``run_config``, hand the merged config to ``submit``, return the summary.

    ``submit(run_config) -> exit code`` starts the run (``flwr run`` on some
    connection) and waits for it. The config is checked here first, so a typo fails
    at once. ``flwr run`` exits 0 even when the ServerApp fails, so success is
    judged by a complete ``summary.json`` written by this run.
    """
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
