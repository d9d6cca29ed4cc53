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
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from fedspc_app.launch.processes import (
    OwnedProcess,
    child_env,
    console_script,
    free_port,
    launch_failed,
    run_logged,
)
from fedspc_app.launch.runconfig import (
    APP_DIR,
    check_clients,
    resolve_run_config,
    run_config_file,
)
from fedspc_app.runs.pause import RunPaused
from fedspc_app.runs.provenance import origin_env
from fedspc_app.runs.runfolder import claim_run_folder

CONNECTION = "fedspc-sim"


# The SuperLink's /health is on this machine's loopback, which a proxy of the
# environment ($http_proxy, without no_proxy) cannot reach: ask it directly.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def flower_env(flwr_home: str | os.PathLike[str]) -> dict[str, str]:
    """Environment for Flower's processes and ``flwr``: a private home, no runtime
    installs, this interpreter's console scripts first on PATH, and the checkout's
    git commit (:func:`fedspc_app.runs.provenance.origin_env`)."""
    env = child_env()
    env.update({
        "FLWR_HOME": str(Path(flwr_home)),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
        # The checkout the FAB is built from, for the runs' config.json (provenance).
        **origin_env(APP_DIR),
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
        self._owned: OwnedProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def process(self) -> subprocess.Popen | None:
        """The ``flower-superlink`` process while it is owned (None before start, after stop)."""
        return self._owned.process if self._owned else None

    def start(self) -> LocalSuperLink:
        """Start it and wait for ``/health``; :class:`LaunchFailed` (quoting the log's
        tail) if it exits or stays silent for ``startup_timeout`` s."""
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
        self._owned = OwnedProcess(command, env=flower_env(self.flwr_home),
                                   log_file=self.log_file).start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self._owned.alive():
                error = launch_failed(
                    f"flower-superlink exited with code {self._owned.process.returncode}",
                    self.log_file)
                self.stop()
                raise error
            with contextlib.suppress(OSError), \
                    _DIRECT.open(f"http://{self.address}/health", timeout=1):
                return self
            time.sleep(0.3)
        error = launch_failed(
            f"flower-superlink did not start within {self.startup_timeout:.0f} s", self.log_file)
        self.stop()
        raise error

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the SuperLink with its SuperExec, ServerApps and Ray (:func:`stop_tree`)."""
        if self._owned is not None:
            self._owned.stop(timeout)
            self._owned = None

    def __enter__(self) -> LocalSuperLink:
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
    with run_config_file(run_config) as config_path:
        command = [
            console_script("flwr"), "run", str(app_dir), CONNECTION, "--stream",
            "--run-config", config_path,
            "--federation-config", federation_config(clients, client_cpus, client_gpus),
        ]
        return run_logged(command, env=flower_env(superlink.flwr_home), log_file=log_file,
                          timeout=timeout, echo=echo, what="flwr run")


class SimulationFailed(RuntimeError):
    """A submitted run ended without writing a complete summary."""


# The ServerApp's one-line reason for refusing or stopping a run (server_app.py).
SERVER_ERROR = re.compile(r"Run (not started|stopped): (.+)")


def server_error(log_file: Path | None, offset: int = 0) -> str | None:
    """The last reason the ServerApp logged after byte ``offset`` of ``log_file``."""
    if log_file is None:
        return None
    try:
        with open(log_file, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    found = SERVER_ERROR.findall(text)
    return f"{found[-1][0]}: {found[-1][1].strip()}" if found else None


def submit_and_check(run_config: Mapping[str, Any], submit: Callable[[dict], int], *,
                     app_dir: Path = APP_DIR, log_file: Path | None = None) -> dict[str, Any]:
    """Validate ``run_config``, hand the merged config to ``submit``, return the summary.

    ``submit(merged) -> exit code`` runs it (``flwr run`` on some connection) and
    waits. ``flwr run`` exits 0 even when the ServerApp fails, so success is a
    complete ``summary.json`` written by this run; a failure names the ServerApp's
    reason when ``log_file`` holds it. A run that stopped on a pause request raises
    :class:`RunPaused`.
    """
    merged, config = resolve_run_config(run_config, app_dir)
    config, note = claim_run_folder(config)  # the folder the ServerApp will write
    if note:
        merged["run-name"] = config.run_name
        print(f"fedspc: {note}", file=sys.stderr, flush=True)
    summary_path = config.run_dir / "summary.json"
    offset = log_file.stat().st_size if log_file is not None and log_file.exists() else 0
    started = time.time()
    code = submit(merged)
    if code != 0 or not summary_path.exists() or summary_path.stat().st_mtime < started:
        where = f"; see {log_file}" if log_file else ""
        reason = server_error(log_file, offset)
        raise SimulationFailed(f"run {config.resolved_run_name!r} " + (
            reason if reason else f"did not complete (flwr exit code {code})") + where)
    summary = json.loads(summary_path.read_text())
    if not summary.get("complete") and isinstance(summary.get("paused-after-round"), int):
        raise RunPaused(summary["paused-after-round"], config.num_rounds,
                        config.resolved_run_name, str(summary.get("paused-by") or ""))
    if not summary.get("complete"):
        raise SimulationFailed(f"run {config.resolved_run_name!r} stopped early: {summary}")
    return summary


def run_simulation(run_config: Mapping[str, Any], *, superlink: LocalSuperLink,
                   clients: int, client_cpus: float = 1.0, client_gpus: float = 0.0,
                   app_dir: Path = APP_DIR, log_file: Path | None = None,
                   timeout: float | None = None, echo: bool = False) -> dict[str, Any]:
    """Validate, submit and wait for one simulated run; return its ``summary.json``."""
    check_clients(resolve_run_config(run_config, app_dir)[1].num_clients, clients)
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
