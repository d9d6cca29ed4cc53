"""A two-node Ray cluster on loopback, for the deployment tests' multi-node simulation.

Each node is a :class:`fedspc_app.launch.processes.OwnedProcess` (its own session and
log, stopped by PID with everything it started).
"""

from __future__ import annotations

import os

from fedspc_app.launch.processes import OwnedProcess, child_env, console_script, free_port


def _ray_ports() -> list[str]:
    """Free ports for the per-node Ray services whose defaults are fixed numbers."""
    args: list[str] = []
    for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                 "--metrics-export-port", "--runtime-env-agent-port"):
        args += [flag, str(free_port())]
    return args


def _ray_env() -> dict[str, str]:
    env = child_env()
    env.pop("RAY_ADDRESS", None)
    return env


def ray_head_process(temp_dir: str | os.PathLike[str], *, port: int, num_cpus: int,
                     log_file: str | os.PathLike[str]) -> OwnedProcess:
    """``ray start --head --block`` on loopback with free ports and its own temp dir (a
    plain ``ray.init()`` elsewhere joins the cluster recorded in the default one).
    ``--block`` keeps it the parent of every Ray process, so stopping it stops the
    cluster (``ray stop`` would stop every Ray instance on the machine)."""
    command = [console_script("ray"), "start", "--head", "--block", "--port", str(port),
               "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
               "--num-gpus", "0", "--include-dashboard", "false",
               "--ray-client-server-port", str(free_port()),
               "--temp-dir", str(temp_dir), "--disable-usage-stats", *_ray_ports()]
    return OwnedProcess(command, env=_ray_env(), log_file=log_file)


def ray_worker_process(head: str, *, num_cpus: int,
                       log_file: str | os.PathLike[str]) -> OwnedProcess:
    """``ray start --address <head> --block``: a worker node joining the cluster at ``head``."""
    command = [console_script("ray"), "start", "--address", head, "--block",
               "--num-cpus", str(num_cpus), "--num-gpus", "0", "--disable-usage-stats",
               *_ray_ports()]
    return OwnedProcess(command, env=_ray_env(), log_file=log_file)
