"""Flower and Ray processes owned by the caller, always stopped by PID.

Each process starts in its own session. :meth:`OwnedProcess.stop` first lists the
process and all its descendants (Flower's SuperLink starts its SuperExec in a
session of its own, and that one starts the ServerApp), then sends SIGTERM to each
of them, waits, and sends SIGKILL to whatever is left, checking every PID against
the process it was when listed (so a reused PID is never hit). Nothing is ever
looked up by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedspc_app.launch.processes import console_script as _bin
from fedspc_app.launch.processes import free_port
from fedspc_app.launch.superlink import simulation_env

DEPLOY_DIR = Path(__file__).resolve().parent


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (stat field 22), or None if it is gone."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def owned_processes(pid: int, *, with_root: bool = True) -> dict[int, str]:
    """``pid``, its living descendants and the members of its session, with start times.

    The session catches children orphaned by an early exit of ``pid``; the tree
    catches descendants that started sessions of their own. ``with_root=False``
    (``pid`` has exited and may since have been reused) lists only the session.
    """
    children: dict[int, list[int]] = {}
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if not fields:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        if int(fields[3]) == pid:  # session id
            found[int(entry.name)] = fields[19]
    found.pop(pid, None)
    visited: set[int] = set() if with_root else {pid}
    todo = [pid, *found]
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        started = _start_time(current)
        if started is not None:
            found[current] = started
            todo.extend(children.get(current, []))
    return found


def _signal_tree(tree: Mapping[int, str], sig: int) -> None:
    for pid, started in tree.items():
        if _start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


class OwnedProcess:
    """A command started in a new session, logging to a file, stopped with its descendants.

    Parameters
    ----------
    command : sequence of str
    env : mapping
        The full environment of the process.
    log_file : path-like
        stdout and stderr (appended).
    cwd : path-like, optional
    """

    def __init__(self, command: Sequence[str], *, env: Mapping[str, str],
                 log_file: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None
                 ) -> None:
        self.command = [str(part) for part in command]
        self.env = dict(env)
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
        self.started_at = _start_time(self.process.pid)
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
        """SIGTERM the process and its descendants, SIGKILL what is left; the exit code."""
        if self.process is None:
            return None
        root = self.process.pid
        tree = owned_processes(root, with_root=_start_time(root) == self.started_at)
        _signal_tree(tree, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        others = {pid: started for pid, started in tree.items() if pid != root}
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
                _start_time(pid) == started for pid, started in others.items()):
            time.sleep(0.2)
        _signal_tree(tree, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        code = self.process.returncode
        self.process = None
        return code

    def __enter__(self) -> OwnedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def deployment_env(flwr_home: str | os.PathLike[str],
                   extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment with a private ``FLWR_HOME`` and no runtime dependency installs."""
    env = simulation_env(Path(flwr_home))
    env.update(extra or {})
    return env


def wait_healthy(address: str, *, ca_file: str | os.PathLike[str] | None,
                 process: OwnedProcess, timeout: float = 90.0) -> None:
    """Wait until the SuperLink at ``address`` answers ``/health`` (over TLS with ``ca_file``)."""
    scheme = "https" if ca_file else "http"
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"the SuperLink exited; see {process.log_file}")
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"{scheme}://{address}/health", timeout=2, context=context):
            return
        time.sleep(0.3)
    raise RuntimeError(f"the SuperLink did not answer within {timeout:.0f} s; "
                       f"see {process.log_file}")


def superlink_process(flwr_home: str | os.PathLike[str], *, port: int,
                      certs_dir: str | os.PathLike[str] | None, node_auth: bool = True,
                      host: str = "127.0.0.1", log_file: str | os.PathLike[str],
                      extra_args: Sequence[str] = (),
                      env: Mapping[str, str] | None = None) -> OwnedProcess:
    """``deploy/start-superlink.sh`` as an :class:`OwnedProcess` (not started).

    ``flwr_home`` (created if missing) is also its working directory.
    """
    Path(flwr_home).mkdir(parents=True, exist_ok=True)
    command = ["bash", DEPLOY_DIR / "start-superlink.sh", "--host", host, "--port", str(port)]
    if certs_dir is None:
        command.append("--insecure")
    else:
        command += ["--certs", str(certs_dir)]
        if not node_auth:
            command.append("--no-auth")
    if extra_args:
        command += ["--", *extra_args]
    return OwnedProcess(command, env=deployment_env(flwr_home, env), log_file=log_file,
                        cwd=flwr_home)


def supernode_process(flwr_home: str | os.PathLike[str], *, superlink: str,
                      partition_id: int, num_partitions: int, port: int,
                      ca_file: str | os.PathLike[str] | None,
                      private_key: str | os.PathLike[str] | None = None,
                      state_dir: str | os.PathLike[str] | None = None,
                      data_dir: str | os.PathLike[str] | None = None,
                      log_file: str | os.PathLike[str],
                      extra_args: Sequence[str] = ()) -> OwnedProcess:
    """``deploy/start-supernode.sh`` as an :class:`OwnedProcess` (not started).

    ``flwr_home`` (created if missing) is also its working directory.
    """
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
    return OwnedProcess(command, env=deployment_env(flwr_home), log_file=log_file,
                        cwd=flwr_home)


def run_flwr(args: Sequence[str], *, flwr_home: str | os.PathLike[str], timeout: float,
             log_file: str | os.PathLike[str] | None = None,
             cwd: str | os.PathLike[str] | None = None,
             in_flight: set[OwnedProcess] | None = None) -> subprocess.CompletedProcess:
    """Run the ``flwr`` CLI to completion (stopped with its descendants after ``timeout``).

    While it runs, the process is a member of ``in_flight``, so that an owner on
    another thread can stop it.
    """
    process = OwnedProcess([_bin("flwr"), *args], env=deployment_env(flwr_home),
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
    return subprocess.CompletedProcess([_bin("flwr"), *args], code, output, "")


def _ray_ports() -> list[str]:
    """Free ports for the per-node Ray services whose defaults are fixed numbers."""
    args: list[str] = []
    for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                 "--metrics-export-port", "--runtime-env-agent-port"):
        args += [flag, str(free_port())]
    return args


def _ray_env() -> dict[str, str]:
    env = os.environ.copy()
    env.pop("RAY_ADDRESS", None)
    return env


def ray_head_process(temp_dir: str | os.PathLike[str], *, port: int, num_cpus: int,
                     log_file: str | os.PathLike[str]) -> OwnedProcess:
    """``ray start --head --block`` on loopback with its own temp dir and free ports.

    Its own ``--temp-dir`` matters beyond tidiness: ``ray start`` records the new
    cluster's address in ``<temp-dir>/ray_current_cluster``, and a plain
    ``ray.init()`` elsewhere on the machine connects to the cluster recorded in
    the default ``/tmp/ray``; a private temp dir keeps other users' simulations off
    this one. ``--block`` keeps ``ray start`` in the foreground as the parent of
    every Ray process, so stopping it by PID stops the cluster (``ray stop`` would
    stop every Ray instance on the machine).
    """
    command = [_bin("ray"), "start", "--head", "--block", "--port", str(port),
               "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
               "--num-gpus", "0", "--include-dashboard", "false",
               "--ray-client-server-port", str(free_port()),
               "--temp-dir", str(temp_dir), "--disable-usage-stats", *_ray_ports()]
    return OwnedProcess(command, env=_ray_env(), log_file=log_file)


def ray_worker_process(head: str, *, num_cpus: int,
                       log_file: str | os.PathLike[str]) -> OwnedProcess:
    """``ray start --address <head> --block``: a worker node joining the cluster at ``head``."""
    command = [_bin("ray"), "start", "--address", head, "--block",
               "--num-cpus", str(num_cpus), "--num-gpus", "0", "--disable-usage-stats",
               *_ray_ports()]
    return OwnedProcess(command, env=_ray_env(), log_file=log_file)
