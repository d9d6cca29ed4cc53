"""The deployment's processes: SuperLink, SuperNodes and the ``flwr`` CLI.

Each is a :class:`fedspc_app.launch.processes.OwnedProcess`: its own session, a
log file, stopped by PID together with everything it started.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from fedspc_app.launch.processes import (
    OwnedProcess,
    console_script,
    launch_failed,
)
from fedspc_app.launch.superlink import flower_env

DEPLOY_DIR = Path(__file__).resolve().parent


def wait_healthy(address: str, *, ca_file: str | os.PathLike[str] | None,
                 process: OwnedProcess, timeout: float = 90.0) -> None:
    """Wait until the SuperLink at ``address`` answers ``/health`` (over TLS with ``ca_file``)."""
    scheme = "https" if ca_file else "http"
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise launch_failed(f"the SuperLink exited with code {process.process.returncode}",
                                process.log_file)
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"{scheme}://{address}/health", timeout=2, context=context):
            return
        time.sleep(0.3)
    raise launch_failed(f"the SuperLink did not answer within {timeout:.0f} s",
                        process.log_file)


def superlink_process(flwr_home: str | os.PathLike[str], *, port: int,
                      certs_dir: str | os.PathLike[str] | None, node_auth: bool = True,
                      host: str = "127.0.0.1", log_file: str | os.PathLike[str],
                      database: str | os.PathLike[str] | None = None) -> OwnedProcess:
    """``deploy/start-superlink.sh`` (not started), in ``flwr_home`` (created if missing)."""
    Path(flwr_home).mkdir(parents=True, exist_ok=True)
    command = ["bash", DEPLOY_DIR / "start-superlink.sh", "--host", host, "--port", str(port)]
    if certs_dir is None:
        command.append("--insecure")
    else:
        command += ["--certs", str(certs_dir)]
        if not node_auth:
            command.append("--no-auth")
    if database is not None:
        command += ["--database", str(database)]
    return OwnedProcess(command, env=flower_env(flwr_home), log_file=log_file,
                        cwd=flwr_home)


def supernode_process(flwr_home: str | os.PathLike[str], *, superlink: str,
                      partition_id: int, num_partitions: int, port: int,
                      ca_file: str | os.PathLike[str] | None,
                      private_key: str | os.PathLike[str] | None = None,
                      state_dir: str | os.PathLike[str] | None = None,
                      data_dir: str | os.PathLike[str] | None = None,
                      log_file: str | os.PathLike[str],
                      extra_args: Sequence[str] = ()) -> OwnedProcess:
    """``deploy/start-supernode.sh`` (not started), in ``flwr_home`` (created if missing)."""
    Path(flwr_home).mkdir(parents=True, exist_ok=True)
    command = ["bash", DEPLOY_DIR / "start-supernode.sh", "--superlink", superlink,
               "--partition-id", str(partition_id), "--num-partitions", str(num_partitions),
               "--port", str(port)]
    if ca_file is None:
        command.append("--insecure")
    else:
        command += ["--ca", str(ca_file)]
    if private_key is not None:
        command += ["--key", str(private_key)]
    command += ["--state-dir", str(state_dir)] if state_dir is not None else ["--no-state-dir"]
    if data_dir is not None:
        command += ["--data-dir", str(data_dir)]
    if extra_args:
        command += ["--", *extra_args]
    return OwnedProcess(command, env=flower_env(flwr_home), log_file=log_file,
                        cwd=flwr_home)


def run_flwr(args: Sequence[str], *, flwr_home: str | os.PathLike[str], timeout: float,
             log_file: str | os.PathLike[str] | None = None,
             cwd: str | os.PathLike[str] | None = None,
             in_flight: set[OwnedProcess] | None = None) -> subprocess.CompletedProcess:
    """Run the ``flwr`` CLI to completion (stopped after ``timeout``); while it runs it is
    in ``in_flight``, where an owner on another thread can stop it."""
    process = OwnedProcess([console_script("flwr"), *args], env=flower_env(flwr_home),
                           log_file=log_file or Path(flwr_home) / "flwr-cli.log", cwd=cwd)
    before = process.log_file.stat().st_size if process.log_file.exists() else 0
    process.start()
    popen = process.process
    if in_flight is not None:
        in_flight.add(process)
    try:
        code = popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.stop()
        raise TimeoutError(f"flwr {' '.join(args[:2])} exceeded {timeout:.0f} s; "
                           f"see {process.log_file}") from None
    finally:
        if in_flight is not None:
            in_flight.discard(process)
    process.stop()  # descendants it may have left, if any
    output = process.log_file.read_bytes()[before:].decode(errors="replace")
    return subprocess.CompletedProcess(process.command, code, output, "")
