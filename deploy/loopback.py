"""A whole FedSPC deployment on this machine: one SuperLink, N SuperNodes, the CLI.

It runs exactly what docs/deployment.md has an operator run on separate machines
(``start-superlink.sh``, ``start-supernode.sh``, ``flwr supernode register``,
``flwr run``), on loopback with free ports, a private ``FLWR_HOME`` per party,
TLS and SuperNode authentication on by default, and a state directory per node.
Every process is stopped by PID when done. For a first try, and to time a
deployment against the simulation of the same config::

    python -m deploy.loopback --nodes 2 --set "method='fedrep' fedspc=true num-rounds=3 local-epochs=1"
    python -m deploy.loopback --nodes 2 --compare-simulation --set "num-rounds=3 local-epochs=1"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deploy.connection import write_connection
from deploy.pki import (
    CertificatePaths,
    NodeKeyPaths,
    create_certificates,
    create_node_key,
)
from deploy.processes import (
    run_flwr,
    superlink_process,
    supernode_process,
    wait_healthy,
)
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import FedSPCError
from fedspc_app.launch.cli import (
    BAD_INPUT,
    FAILED,
    PAUSED,
    RUN_ERRORS,
    add_run_config_arguments,
    fail,
)
from fedspc_app.launch.processes import (
    LaunchFailed,
    OwnedProcess,
    exit_on_termination,
    free_port,
    launch_failed,
)
from fedspc_app.launch.runconfig import (
    APP_DIR,
    app_defaults,
    check_resources,
    load_overrides,
    run_config_file,
)
from fedspc_app.launch.superlink import run_simulation, simulation, submit_and_check
from fedspc_app.runs.pause import RunPaused

CONNECTION = "fedspc-loopback"
CONNECTED = "SuperNode ID:"  # what a SuperNode logs once the SuperLink accepted it


class LoopbackDeployment:
    """A SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1, owned by this process.

    Parameters
    ----------
    root : path-like
        Working folder: certificates, keys, one ``FLWR_HOME`` per party, logs, state.
    num_nodes : int
        SuperNodes, with ``partition-id`` 0..N-1 and ``num-partitions = N``.
    tls : bool
        Serve the SuperLink over TLS (a fresh CA); otherwise ``--insecure``.
    node_auth : bool
        Admit only registered SuperNode keys (needs ``tls``).
    durable : bool
        Give every SuperNode a ``state-dir``.
    """

    def __init__(self, root: str | Path, num_nodes: int, *, tls: bool = True,
                 node_auth: bool = True, durable: bool = True) -> None:
        if node_auth and not tls:
            raise ValueError("SuperNode authentication needs TLS")
        self.root = Path(root)
        self.num_nodes = num_nodes
        self.tls = tls
        self.node_auth = node_auth
        self.durable = durable
        self.home = self.root / "superlink"  # the SuperLink's and the CLI's FLWR_HOME
        self.certs: CertificatePaths | None = None
        self.keys: list[NodeKeyPaths] = []
        self.port = 0
        self.superlink: OwnedProcess | None = None
        self.nodes: dict[int, OwnedProcess] = {}
        self.node_ports: dict[int, int] = {}
        self.cli: set[OwnedProcess] = set()  # flwr commands running now

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path | None:
        return self.certs.ca_cert if self.certs else None

    def state_dir(self, partition_id: int) -> Path | None:
        return self.root / f"node-{partition_id}" / "state" if self.durable else None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120.0) -> LoopbackDeployment:
        """Certificates and keys, the SuperLink, the CLI connection, registration, nodes."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        if self.tls:
            self.certs = create_certificates(self.root / "certs")
        if self.node_auth:
            self.keys = [create_node_key(self.root / "keys", f"node-{i}")
                         for i in range(self.num_nodes)]
        self.port = free_port()
        self.start_superlink(timeout)
        write_connection(self.home, CONNECTION, self.address,
                         root_certificates=self.ca_file, insecure=not self.tls)
        for key in self.keys:
            result = self.register(key.public_key)
            if result.returncode != 0:
                raise LaunchFailed(f"registering {key.public_key} failed:\n{result.stdout}")
        for partition_id in range(self.num_nodes):
            self.start_node(partition_id)
        for partition_id in range(self.num_nodes):
            self.wait_connected(partition_id, timeout)
        return self

    def start_superlink(self, timeout: float = 120.0) -> None:
        """The SuperLink, keeping its state (registered SuperNodes, runs) in an SQLite
        file so that a restarted SuperLink knows its SuperNodes again."""
        self.superlink = superlink_process(
            self.home, port=self.port, certs_dir=self.certs.ca_cert.parent if self.certs
            else None, node_auth=self.node_auth, log_file=self.root / "superlink.log",
            database=self.home / "superlink.db")
        self.superlink.start()
        wait_healthy(self.address, ca_file=self.ca_file, process=self.superlink,
                     timeout=timeout)

    def restart_superlink(self, timeout: float = 120.0) -> None:
        """Kill the SuperLink with everything it started (SIGKILL, as a crash would) and
        start it again on the same port and database; the SuperNodes keep running and
        reconnect by themselves."""
        if self.superlink is not None:
            self.superlink.stop(timeout=0)
        self.start_superlink(timeout)

    def stop(self) -> None:
        """Stop running flwr commands, every SuperNode, then the SuperLink, all by PID."""
        for process in list(self.cli):
            process.stop()
        for partition_id in list(self.nodes):
            self.stop_node(partition_id)
        if self.superlink is not None:
            self.superlink.stop()
            self.superlink = None

    def __enter__(self) -> LoopbackDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- SuperNodes
    def node_process(self, partition_id: int, *, private_key: Path | None | str = "own",
                     insecure: bool = False, log_name: str | None = None,
                     port: int | None = None,
                     extra_args: tuple[str, ...] = ()) -> OwnedProcess:
        """A SuperNode for ``partition_id`` (not started); keys and TLS can be overridden.

        ``port`` is its Runtime API port (default: a free one).
        """
        if private_key == "own":
            private_key = self.keys[partition_id].private_key if self.keys else None
        port = port or free_port()
        home = self.root / f"node-{partition_id}"
        home.mkdir(parents=True, exist_ok=True)
        return supernode_process(
            home, superlink=self.address, partition_id=partition_id,
            num_partitions=self.num_nodes, port=port,
            ca_file=None if insecure else self.ca_file,
            private_key=private_key, state_dir=self.state_dir(partition_id),
            log_file=self.root / (log_name or f"node-{partition_id}.log"),
            extra_args=extra_args)

    def start_node(self, partition_id: int, *, log_name: str | None = None) -> OwnedProcess:
        if partition_id in self.nodes:
            raise RuntimeError(f"SuperNode {partition_id} is already running")
        port = self.node_ports.setdefault(partition_id, free_port())
        node = self.node_process(partition_id, log_name=log_name, port=port).start()
        self.nodes[partition_id] = node
        return node

    def stop_node(self, partition_id: int) -> int | None:
        """Stop a SuperNode gracefully (SIGTERM: it signs off, and may rejoin at once)."""
        return self.nodes.pop(partition_id).stop()

    def wait_connected(self, partition_id: int, timeout: float = 120.0) -> None:
        node = self.nodes[partition_id]
        if not node.wait_for_log(CONNECTED, timeout):
            raise launch_failed(f"SuperNode {partition_id} did not connect within "
                                f"{timeout:.0f} s", node.log_file)

    # ----------------------------------------------------------------- flwr CLI
    def flwr(self, *args: str, timeout: float = 120.0):
        """Run ``flwr <args>`` with this deployment's CLI ``FLWR_HOME``."""
        return run_flwr(list(args), flwr_home=self.home, timeout=timeout, cwd=APP_DIR,
                        in_flight=self.cli)

    def register(self, public_key: Path):
        return self.flwr("supernode", "register", str(public_key), CONNECTION)

    def online_nodes(self) -> list[int]:
        """IDs of the SuperNodes the SuperLink lists as online."""
        result = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        if result.returncode != 0:
            raise LaunchFailed(f"flwr supernode list failed:\n{result.stdout}")
        text = result.stdout
        listing = json.loads(text[text.index("{"):text.rindex("}") + 1])
        return [int(node["node-id"]) for node in listing.get("nodes", [])
                if node.get("status") == "online"]

    def submit(self, run_config: Mapping[str, Any], *, log_file: Path,
               timeout: float) -> int:
        """``flwr run . <connection> --stream`` with ``run_config``; its exit code."""
        with run_config_file(run_config) as config_path:
            result = run_flwr(["run", str(APP_DIR), CONNECTION, "--stream",
                               "--run-config", config_path],
                              flwr_home=self.home, timeout=timeout, log_file=log_file,
                              cwd=APP_DIR, in_flight=self.cli)
        return result.returncode

    def run(self, run_config: Mapping[str, Any], *, log_file: Path,
            timeout: float = 900.0) -> dict[str, Any]:
        """Validate, submit and wait for one run (``num-clients`` defaults to the number
        of SuperNodes); its ``summary.json``, see :func:`submit_and_check`."""
        return submit_and_check(
            {"num-clients": self.num_nodes, **run_config},
            lambda merged: self.submit(merged, log_file=log_file, timeout=timeout),
            log_file=log_file)


def round_seconds(run_dir: Path) -> list[float]:
    """``round-seconds`` of every round in a run's metrics.json."""
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    return [float(row["round-seconds"]) for row in metrics["rounds"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.loopback",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="SuperNodes (= num-clients)")
    add_run_config_arguments(parser)
    parser.add_argument("--insecure", action="store_true", help="no TLS, no node auth")
    parser.add_argument("--workdir", help="keep certificates, logs and state here")
    parser.add_argument("--compare-simulation", action="store_true",
                        help="also run the same config in the simulation engine and "
                             "print both per-round times")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    try:
        run_config = load_overrides(args.run_config, args.set)
        check_resources(args.nodes, 1.0, 0.0)
        name = parse_run_config({**app_defaults(), **run_config}).resolved_run_name
    except FedSPCError as error:
        return fail(error, BAD_INPUT)
    output = Path(run_config.get("output-dir", "results")).resolve()
    deployed = {**run_config, "output-dir": str(output), "run-name": f"{name}-deployed"}
    simulated = {**run_config, "output-dir": str(output), "run-name": f"{name}-simulated",
                 "num-clients": args.nodes}
    with contextlib.ExitStack() as stack:
        root = Path(args.workdir) if args.workdir else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="fedspc-loopback-")))
        try:
            with exit_on_termination():
                with LoopbackDeployment(root, args.nodes, tls=not args.insecure,
                                        node_auth=not args.insecure) as deployment:
                    print(f"SuperLink {deployment.address}, {args.nodes} SuperNodes; "
                          f"logs in {root}")
                    deployment.run(deployed, log_file=root / "run.log", timeout=args.timeout)
                times = round_seconds(output / f"{name}-deployed")
                print(f"deployment: {len(times)} rounds, seconds per round {times}")
                if args.compare_simulation:
                    with simulation() as superlink:
                        run_simulation(simulated, superlink=superlink, clients=args.nodes,
                                       log_file=root / "simulation.log", timeout=args.timeout)
                    times = round_seconds(output / f"{name}-simulated")
                    print(f"simulation: {len(times)} rounds, seconds per round {times}")
        except RunPaused as paused:
            return fail(paused, PAUSED)
        except RUN_ERRORS as error:
            return fail(error, FAILED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
