"""The app in Flower's deployment engine, and the simulation on an existing Ray cluster.

In-process tests (no marker) run the real ServerApp and ClientApp with the
deployment code path switched on: a server without the data, the SuperNodes'
check before training, the partition file written from what they report.

Loopback tests start real processes (deploy/loopback.py): one SuperLink with TLS
and SuperNode authentication and two SuperNodes with a state directory each, on
free ports, with private FLWR_HOMEs, all stopped by PID at the end of the module;
a Ray head and a Ray worker node for the simulation. One of them is in the
``e2e`` set, which the default ``pytest -q`` runs; the others carry the
``deploy`` marker, which it leaves out (pyproject's addopts): run them with
``pytest -m deploy``. Each message in a deployment starts a ClientApp process
(importing torch) and waits for a ~3 s poll, so rounds take tens of seconds here:
the runs are 2-3 rounds of one local epoch on digits.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from inprocess import InProcessGrid
from ray_cluster import ray_head_process, ray_worker_process
from test_data import _write_cifar10

from clients.durable import DurableState
from deploy.connection import write_connection
from deploy.loopback import CONNECTED, LoopbackDeployment
from deploy.pki import create_certificates, create_node_key
from deploy.pki import main as pki_main
from deploy.processes import wait_healthy
from fedspc_app import client_app, server_app
from fedspc_app.client_app import node_run_config
from fedspc_app.core.config import DATASETS, parse_run_config
from fedspc_app.core.methods import get_method
from fedspc_app.data.datasets import load_dataset
from fedspc_app.data.run_data import KNOWN_SHAPES, dataset_shape, load_partition
from fedspc_app.launch.processes import (
    LaunchFailed,
    OwnedProcess,
    free_port,
    owned_processes,
    start_time,
)
from fedspc_app.launch.superlink import LocalSuperLink, SimulationFailed, run_simulation
from fedspc_app.models.run_model import make_model
from fedspc_app.models.split import parameter_split
from fedspc_app.server import deployment as deployment_module


# ============================================================== in-process: server side
def run_server(grid: InProcessGrid, run_config: dict) -> None:
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))


def in_one_process(run_config: dict, folder: Path) -> list[dict]:
    """The rounds of ``run_config`` on 2 clients in one process (the simulation's code
    path), its results under ``folder``."""
    local = {**run_config, "num-clients": 2, "output-dir": str(folder)}
    run_server(InProcessGrid(client_app.app, 2, local), local)
    return json.loads((folder / local["run-name"] / "metrics.json").read_text())["rounds"]


def assert_same_rounds(rounds: list[dict], other: list[dict], keys: tuple[str, ...],
                       rel: float) -> None:
    for key in keys:
        assert [r[key] for r in rounds] == pytest.approx([r[key] for r in other],
                                                         rel=rel), key


@pytest.fixture
def deployed(monkeypatch):
    """The ServerApp takes the deployment code path (as under Flower's HTTP Grid)."""
    monkeypatch.setattr(server_app, "is_deployment", lambda grid: True)


@pytest.fixture
def cifar10_on_the_clients(tmp_path, monkeypatch):
    """A small CIFAR-10 on the nodes (node-config data-dir); none where the server looks."""
    monkeypatch.setenv("FEDSPC_CACHE_DIR", str(tmp_path / "cache"))
    data_dir = tmp_path / "client-data"
    _write_cifar10(data_dir, per_batch=8, n_test=12)
    run_config = {"dataset": "cifar10", "data-dir": str(tmp_path / "not-on-the-server"),
                  "download": False, "num-rounds": 1, "local-epochs": 1, "batch-size": 16,
                  "alpha": 1.0, "min-samples": 2, "num-clients": 2,
                  "output-dir": str(tmp_path / "out"), "run-name": "cifar"}
    grid = InProcessGrid(client_app.app, 2, run_config)
    for context in grid.contexts.values():
        context.node_config["data-dir"] = str(data_dir)
    return grid, run_config, data_dir


def test_known_shapes_are_those_the_datasets_load_with(tmp_path):
    assert dataset_shape(load_dataset("digits", None)) == KNOWN_SHAPES["digits"]
    _write_cifar10(tmp_path / "c10")
    assert dataset_shape(load_dataset("cifar10", tmp_path / "c10", download=False)) \
        == KNOWN_SHAPES["cifar10"]
    assert set(KNOWN_SHAPES) == set(DATASETS)


def test_deployment_is_told_apart_from_simulation_by_flowers_grid():
    from flwr.superlink.grid import HttpGrid, InMemoryGrid

    assert deployment_module.is_deployment(HttpGrid.__new__(HttpGrid))
    assert not deployment_module.is_deployment(InMemoryGrid.__new__(InMemoryGrid))
    assert not deployment_module.is_deployment(InProcessGrid(client_app.app, 1, {}))


def test_node_config_data_dir_overrides_the_run_config(tmp_path):
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0,
                                                        "num-partitions": 2},
                      state=RecordDict(), run_config={"data-dir": "/run/level"})
    assert node_run_config(context).data_dir == "/run/level"
    context.node_config["data-dir"] = str(tmp_path)
    assert node_run_config(context).data_dir == str(tmp_path)


def test_deployed_server_without_the_data_trains_from_the_clients_reports(
        cifar10_on_the_clients, deployed):
    grid, run_config, data_dir = cifar10_on_the_clients
    run_server(grid, run_config)
    run_dir = Path(run_config["output-dir"]) / "cifar"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"]
    # The server could not load the data: the model came from the known CIFAR-10 shape
    # and the sizes from the nodes' reports.
    config = json.loads((run_dir / "config.json").read_text())
    assert config["runtime"] == "deployment"
    assert config["dataset"] == {"name": "cifar10", "train": 40, "test": 12, "classes": 10}
    # The partition file holds exactly what the clients computed from their data.
    written = json.loads((run_dir / "partition.json").read_text())
    expected = load_partition(parse_run_config({**run_config, "data-dir": str(data_dir)}), 2)
    assert written["train_counts"] == expected.train_counts().tolist()
    assert written["test_counts"] == expected.test_counts().tolist()
    assert written["tries"] == expected.tries
    assert written["source"] == "reported by the SuperNodes"
    assert (run_dir / "partition.csv").read_text().startswith("client,split,class_0,")
    # Before training, every node got one query message: the preflight (a deployment
    # has no warm-up).
    assert [m.content.config_records["config"]["query"] for m in grid.queries] == [
        "partition", "partition"]


def test_simulation_still_stops_when_the_server_lacks_the_data(cifar10_on_the_clients):
    grid, run_config, _ = cifar10_on_the_clients
    with pytest.raises(SystemExit, match="cifar-10-batches-py"):
        run_server(grid, run_config)
    assert not grid.sent and not Path(run_config["output-dir"]).exists()


def test_deployment_requires_num_clients(cifar10_on_the_clients, deployed):
    grid, run_config, _ = cifar10_on_the_clients
    with pytest.raises(SystemExit, match="'num-clients' must be the number of SuperNodes"):
        run_server(grid, {**run_config, "num-clients": 0})
    assert not grid.sent


def test_two_nodes_with_one_partition_id_stop_the_run_before_training(
        cifar10_on_the_clients, deployed):
    grid, run_config, _ = cifar10_on_the_clients
    grid.contexts[2].node_config["partition-id"] = 0
    with pytest.raises(SystemExit, match="nodes 1 and 2 both have partition-id=0"):
        run_server(grid, run_config)
    assert not grid.sent and grid.queries  # the preflight's queries, nothing trained
    assert not Path(run_config["output-dir"]).exists()


def test_a_node_without_its_data_stops_the_run_before_training(
        cifar10_on_the_clients, deployed, tmp_path):
    grid, run_config, _ = cifar10_on_the_clients
    grid.contexts[2].node_config["data-dir"] = str(tmp_path / "empty")
    with pytest.raises(SystemExit, match=r"node 2: .*cifar-10-batches-py"):
        run_server(grid, run_config)
    assert not grid.sent and grid.queries  # the preflight's queries, nothing trained


def test_a_node_with_another_num_partitions_stops_the_run(cifar10_on_the_clients, deployed):
    grid, run_config, _ = cifar10_on_the_clients
    grid.contexts[1].node_config["num-partitions"] = 3
    with pytest.raises(SystemExit, match="node 1: .*num-partitions=3"):
        run_server(grid, run_config)


def test_a_node_without_partition_config_is_named(cifar10_on_the_clients, deployed):
    grid, run_config, _ = cifar10_on_the_clients
    del grid.contexts[2].node_config["partition-id"]
    with pytest.raises(SystemExit, match="node 2: .*lacks partition-id: start the SuperNode"):
        run_server(grid, run_config)


# ====================================================================== process tools
def test_a_superlink_that_exits_is_reported_with_the_tail_of_its_log(tmp_path):
    process = OwnedProcess(["sh", "-c", "for n in $(seq 40); do echo line $n; done; exit 4"],
                           env=os.environ, log_file=tmp_path / "superlink.log").start()
    with pytest.raises(LaunchFailed, match="the SuperLink exited with code 4") as caught:
        wait_healthy(f"127.0.0.1:{free_port()}", ca_file=None, process=process, timeout=60)
    assert str(caught.value).splitlines()[-30:] == [f"line {n}" for n in range(11, 41)]
    process.stop()


def test_cli_connection_entry_is_added_without_losing_others(tmp_path):
    certs = create_certificates(tmp_path / "certs", ["10.1.2.3"])
    write_connection(tmp_path, "a", "127.0.0.1:1", insecure=True)
    write_connection(tmp_path, "b", "10.1.2.3:8000", root_certificates=certs.ca_cert)
    import tomllib

    config = tomllib.loads((tmp_path / "config.toml").read_text())["superlink"]
    assert config["default"] == "b"
    assert config["a"] == {"address": "127.0.0.1:1", "insecure": True}
    assert config["b"] == {"address": "10.1.2.3:8000",
                           "root-certificates": str(certs.ca_cert.resolve())}


def test_certificates_verify_against_the_ca_with_the_given_names(tmp_path):
    from cryptography import x509

    certs = create_certificates(tmp_path, ["10.1.2.3", "link.example.org"])
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(map(str, names.get_values_for_type(x509.IPAddress))) == \
        {"127.0.0.1", "::1", "10.1.2.3"}
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "link.example.org"}
    assert oct(certs.server_key.stat().st_mode & 0o777) == "0o600"
    key = create_node_key(tmp_path, "node-0")
    assert key.public_key.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert key.private_key.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")


@pytest.mark.parametrize("host", ["192.168.1.10:8000", "https://link.example.org",
                                  "link.example.org/path", "[::1]:9092", "-bad.example",
                                  "under_score.example"])
def test_certificates_refuse_a_host_with_a_port_or_scheme(tmp_path, host, capsys):
    """Such a name never matches the one a client connects to: TLS would fail later."""
    with pytest.raises(ValueError, match="without a port or scheme"):
        create_certificates(tmp_path / "api", [host])
    with pytest.raises(SystemExit) as stopped:
        pki_main(["certs", "--out", str(tmp_path / "cli"), f"--host={host}"])
    assert stopped.value.code == 2 and "without a port or scheme" in capsys.readouterr().err
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_certificates_take_the_hosts_the_deployment_guide_gives(tmp_path):
    certs = create_certificates(tmp_path, ["192.168.1.10", "server.lan", "[fe80::1]",
                                           "*.example.org", "xn--bcher-kva.example"])
    assert certs.server_cert.is_file()


# ========================================================================== scripts
def fake_flower(tmp_path: Path, name: str) -> dict[str, str]:
    """An environment whose ``name`` prints its arguments, one per line, instead of starting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / name
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def script(name: str, *args: str, env: dict[str, str], cwd: Path):
    return subprocess.run(["bash", str(Path(__file__).parent.parent / "deploy" / name), *args],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=60,
                          check=False)


def test_start_supernode_script_builds_the_node_config(tmp_path):
    from flwr.common.config import parse_config_args

    env = fake_flower(tmp_path, "flower-supernode")
    (tmp_path / "data").mkdir()
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "node-1").write_text("x")
    result = script("start-supernode.sh", "--superlink", "10.0.0.1:8000", "--ca", "ca.crt",
                    "--key", "node-1", "--partition-id", "1", "--num-partitions", "3",
                    "--state-dir", "state", "--data-dir", "data", "--port", "9100",
                    "--", "--max-retries", "5", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    args = result.stdout.splitlines()
    assert args[args.index("--superlink") + 1] == "10.0.0.1:8000"
    assert args[args.index("--root-certificates") + 1] == "ca.crt"
    assert args[args.index("--auth-supernode-private-key") + 1] == "node-1"
    assert args[args.index("--port") + 1] == "9100" and args[-2:] == ["--max-retries", "5"]
    node_config = parse_config_args([args[args.index("--node-config") + 1]])
    assert node_config == {"partition-id": 1, "num-partitions": 3,
                           "state-dir": str(tmp_path / "state"),
                           "data-dir": str(tmp_path / "data")}
    assert (tmp_path / "state").is_dir()
    # By default the state goes to the user's state folder; --no-state-dir keeps it in memory.
    common = ["--superlink", "h:1", "--insecure", "--partition-id", "0", "--num-partitions", "1"]
    default = script("start-supernode.sh", *common,
                     env={**env, "XDG_STATE_HOME": str(tmp_path / "xdg")}, cwd=tmp_path)
    assert parse_config_args([default.stdout.splitlines()[
        default.stdout.splitlines().index("--node-config") + 1]])["state-dir"] \
        == str(tmp_path / "xdg" / "fedspc")
    memory = script("start-supernode.sh", *common, "--no-state-dir", env=env, cwd=tmp_path)
    assert "state-dir" not in memory.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--partition-id", "2", "--num-partitions", "2"], "smaller than --num-partitions"),
    # Leading zeros: bash would read 010 as octal and 08 as an error.
    (["--partition-id", "010", "--num-partitions", "10", "--insecure"],
     "--partition-id must be a decimal integer from 0 to 999999999 without leading zeros"),
    (["--partition-id", "08", "--num-partitions", "10", "--insecure"],
     "--partition-id must be a decimal integer"),
    (["--partition-id", "1", "--num-partitions", "010", "--insecure"],
     "--num-partitions must be a decimal integer"),
    (["--partition-id", "0", "--num-partitions", "0", "--insecure"],
     "--num-partitions must be a positive integer"),
    (["--partition-id", "0", "--num-partitions", "1", "--insecure", "--port", "09094"],
     "--port must be a decimal integer"),
    (["--partition-id", "0", "--num-partitions", "1", "--insecure", "--port", "70000"],
     "--port must be in 1..65535"),
    (["--partition-id", "0", "--num-partitions", "2", "--insecure", "--key", "k"],
     "node authentication is refused over --insecure"),
    (["--partition-id", "0", "--num-partitions", "2"], "--ca FILE is required"),
    (["--partition-id", "0", "--num-partitions", "2", "--insecure", "--data-dir", "nowhere"],
     "is not a folder"),
])
def test_start_supernode_script_refuses_bad_arguments(tmp_path, args, message):
    env = fake_flower(tmp_path, "flower-supernode")
    result = script("start-supernode.sh", "--superlink", "h:1", *args, env=env, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr and not result.stdout


def test_start_superlink_script_enables_tls_and_node_auth(tmp_path):
    env = fake_flower(tmp_path, "flower-superlink")
    certs = create_certificates(tmp_path / "certs")
    result = script("start-superlink.sh", "--certs", str(certs.ca_cert.parent), "--port",
                    "9000", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    args = result.stdout.splitlines()
    assert args[args.index("--ssl-ca-certfile") + 1] == str(certs.ca_cert)
    assert args[args.index("--ssl-certfile") + 1] == str(certs.server_cert)
    assert args[args.index("--ssl-keyfile") + 1] == str(certs.server_key)
    assert "--enable-supernode-auth" in args and "--insecure" not in args
    assert "--disable-runtime-dependency-installation" in args
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] \
        == "9000"
    no_auth = script("start-superlink.sh", "--certs", str(certs.ca_cert.parent), "--no-auth",
                     env=env, cwd=tmp_path).stdout.splitlines()
    assert "--enable-supernode-auth" not in no_auth and "--ssl-certfile" in no_auth
    missing = script("start-superlink.sh", "--certs", str(tmp_path), env=env, cwd=tmp_path)
    assert missing.returncode == 2 and "python -m deploy.pki certs" in missing.stderr
    for port in ("08000", "0", "65536", "80a"):
        refused = script("start-superlink.sh", "--insecure", "--port", port, env=env,
                         cwd=tmp_path)
        assert refused.returncode == 2 and not refused.stdout
        assert f"--port must be a decimal integer in 1..65535 without leading zeros, got " \
            f"'{port}'" in " ".join(refused.stderr.split())


@pytest.mark.parametrize("name", ["flower-superlink", "flower-supernode"])
def test_start_scripts_keep_the_loopback_out_of_a_proxy(tmp_path, name):
    # Flower's processes call each other on 127.0.0.1, which gRPC would send through
    # $http_proxy too; the proxy itself stays for the connections that leave the machine.
    env = fake_flower(tmp_path, name)
    (tmp_path / "bin" / name).write_text('#!/usr/bin/env bash\necho "$no_proxy|$NO_PROXY"\n')
    extra = ["--insecure"] + (["--superlink", "h:1", "--partition-id", "0",
                               "--num-partitions", "1"] if name.endswith("node") else [])
    for proxy_env, expected in (({}, "127.0.0.1,localhost,::1|127.0.0.1,localhost,::1"),
                                ({"no_proxy": "corp", "NO_PROXY": "corp"},
                                 "corp,127.0.0.1,localhost,::1|corp,127.0.0.1,localhost,::1")):
        base = {k: v for k, v in env.items() if k not in ("no_proxy", "NO_PROXY")}
        result = script(f"start-{name.removeprefix('flower-')}.sh", *extra,
                        env={**base, **proxy_env, "http_proxy": "http://proxy:3128"},
                        cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected


def test_submit_merges_a_preset_and_overrides_and_requires_num_clients(tmp_path):
    from deploy.submit import build_run_config
    from fedspc_app.core.errors import FedSPCError

    preset = tmp_path / "preset.toml"
    preset.write_text('method = "fedper"\nnum-rounds = 7\n')
    merged = build_run_config(str(preset), "method='fedrep' fedspc=true", 3)
    assert merged == {"method": "fedrep", "num-rounds": 7, "fedspc": True, "num-clients": 3}
    with pytest.raises(FedSPCError, match="--clients N"):
        build_run_config(str(preset), "", None)
    with pytest.raises(FedSPCError, match="did you mean: method"):
        build_run_config(None, "methd='fedrep'", 2)


# ================================================================== Ray cluster
@contextlib.contextmanager
def two_node_ray(tmp_path, monkeypatch, worker_env=None):
    """A Ray head and a worker on loopback (1 CPU each), joined via RAY_ADDRESS; yields
    Ray's temp folder. ``worker_env``: environment variables only the worker node has.
    Both nodes are stopped by PID, with everything they started."""
    import tempfile

    ray_tmp = Path(tempfile.mkdtemp(prefix="fr", dir="/tmp"))  # Ray's socket paths are short
    port = free_port()
    head = ray_head_process(ray_tmp / "ray", port=port, num_cpus=1,
                            log_file=tmp_path / "ray-head.log").start()
    worker = None
    try:
        assert head.wait_for_log("Ray runtime started", 180), head.log_text()[-2000:]
        with monkeypatch.context() as only_the_worker:
            for name, value in (worker_env or {}).items():
                only_the_worker.setenv(name, value)
            worker = ray_worker_process(f"127.0.0.1:{port}", num_cpus=1,
                                        log_file=tmp_path / "ray-worker.log").start()
        assert worker.wait_for_log("Ray runtime started", 180), worker.log_text()[-2000:]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        yield ray_tmp
    finally:
        for process in (worker, head):
            if process is not None:
                tree = owned_processes(process.pid) if process.process else {}
                process.stop()
                assert all(start_time(pid) != started for pid, started in tree.items())
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.deploy
def test_simulation_runs_on_an_existing_multi_node_ray_cluster(tmp_path, monkeypatch):
    """A Ray head and a worker (1 CPU each); the SuperLink's simulation joins via RAY_ADDRESS.

    Two clients of one CPU each need both nodes: an actor on each. Had the
    simulation started its own Ray instance, no actor would log in this cluster.
    """
    with two_node_ray(tmp_path, monkeypatch) as ray_tmp:
        with LocalSuperLink(tmp_path / "flwr-home") as superlink:
            summary = run_simulation(
                {"num-rounds": 2, "local-epochs": 1, "output-dir": str(tmp_path),
                 "run-name": "on-ray-cluster"},
                superlink=superlink, clients=2, client_cpus=1,
                log_file=tmp_path / "run.log", timeout=900)
        assert summary["complete"]
        logs = ray_tmp / "ray" / "session_latest" / "logs"
        actors = {path.name.split("-")[-1].split(".")[0]
                  for path in logs.glob("worker-*")
                  if "ClientAppActor" in path.read_text(errors="replace")}
        assert len(actors) == 2, sorted(p.name for p in logs.glob("worker-*"))


@pytest.mark.deploy
def test_a_ray_node_without_the_client_state_folder_stops_its_clients(tmp_path, monkeypatch):
    """client-state-dir = "~/fedspc-state": the worker node has another HOME, so it sees
    another folder there (as a machine whose disk is not shared would). Its clients stop
    with the error naming the folder and the fix, instead of starting over silently."""
    monkeypatch.setenv("HOME", str(tmp_path / "head-home"))
    worker_home = {"HOME": str(tmp_path / "worker-home")}
    with two_node_ray(tmp_path, monkeypatch, worker_env=worker_home), \
            LocalSuperLink(tmp_path / "flwr-home") as superlink, \
            pytest.raises(SimulationFailed):
        run_simulation(
            {"method": "fedrep", "fedspc": True, "num-rounds": 2, "local-epochs": 1,
             "output-dir": str(tmp_path), "run-name": "views",
             "client-state-dir": "~/fedspc-state", "min-train-replies": 1.0,
             "max-failed-rounds": 1},
            superlink=superlink, clients=2, client_cpus=1, log_file=tmp_path / "run.log",
            timeout=900)
    metrics = json.loads((tmp_path / "views" / "metrics.json").read_text())
    reasons = " ".join(metrics["rounds"][0]["dropped-reasons"])
    missing = tmp_path / "worker-home" / "fedspc-state" / "views"
    assert f"does not see the client-state folder {missing}" in reasons, reasons
    assert (tmp_path / "head-home" / "fedspc-state" / "views" / "run.json").is_file()
    assert not list(missing.glob("partition-*"))


# ====================================================================== loopback runs
RUN = {"method": "fedrep", "fedspc": True, "local-epochs": 1}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """TLS + SuperNode authentication, two SuperNodes with state dirs; stopped by PID."""
    root = tmp_path_factory.mktemp("loopback")
    deployment = LoopbackDeployment(root, num_nodes=2, tls=True, node_auth=True,
                                    durable=True)
    try:
        deployment.start()
        yield deployment
    finally:
        trees = {}
        for process in [deployment.superlink, *deployment.nodes.values()]:
            if process is not None and process.process is not None:
                trees.update(owned_processes(process.pid))
        deployment.stop()
        for pid, started_at in trees.items():
            assert start_time(pid) != started_at, f"process {pid} survived"


@pytest.mark.e2e
def test_tls_and_node_auth_deployment_trains_fedrep_with_fedspc(deployment, tmp_path):
    assert len(deployment.online_nodes()) == 2
    summary = deployment.run({**RUN, "num-rounds": 2, "output-dir": str(tmp_path),
                              "run-name": "deployed"}, log_file=tmp_path / "run.log",
                             timeout=1200)
    assert summary["complete"] and summary["method"] == "fedrep+fedspc"
    run_dir = tmp_path / "deployed"
    rounds = json.loads((run_dir / "metrics.json").read_text())["rounds"]
    assert [r["min-rounds-trained"] for r in rounds] == [1, 2]
    assert all(r["clients"] == 2 and r["train-clients"] == 2 for r in rounds)
    assert rounds[-1]["global-reference-norm"] > 0
    print("deployment round-seconds:", [r["round-seconds"] for r in rounds])
    # The same config in one process (the simulation's code path) gives the same run.
    local = in_one_process({**RUN, "num-rounds": 2, "run-name": "local"}, tmp_path / "local")
    assert_same_rounds(rounds, local, ("accuracy", "loss", "train-loss"), rel=1e-6)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["runtime"] == "deployment" and config["num-clients"] == 2
    partition = json.loads((run_dir / "partition.json").read_text())
    local = load_partition(parse_run_config({**RUN, "num-clients": 2}), 2)
    assert partition["train_counts"] == local.train_counts().tolist()
    # Every node kept its state on disk: the FedRep head and u_k of the body.
    split = parameter_split(make_model(parse_run_config(RUN), KNOWN_SHAPES["digits"]),
                            get_method("fedrep"))
    for partition_id in (0, 1):
        saved = DurableState(deployment.state_dir(partition_id) / "deployed", "deployed",
                             partition_id).read(any_run=True)
        assert saved.rounds_trained == 2 and saved.round == 2
        assert set(saved.personal) == set(split.personal)
        assert set(saved.local_reference) == set(split.corrected)
        assert any(np.any(v != 0) for v in saved.local_reference.values())
    # The SuperLink served TLS; the CLI trusted it through the CA in its connection.
    assert "Uvicorn running on https://" in deployment.superlink.log_text()
    log = (tmp_path / "run.log").read_text()
    assert "round 2/2" in log and "client state on the node's disk" in log


@pytest.mark.deploy
def test_a_supernode_that_lies_about_its_steps_is_dropped_in_a_deployment(deployment,
                                                                          tmp_path):
    # Partition 0 reports one shared step (FedSPC would scale its reference change by
    # E); the server checks E against the counts the node reported before round 1.
    # The median and a server optimizer run through the deployment too.
    summary = deployment.run({**RUN, "num-rounds": 1, "output-dir": str(tmp_path),
                              "run-name": "liar", "attack": "small-steps",
                              "attack-clients": 1, "aggregation": "median",
                              "server-optimizer": "fedavgm", "server-momentum": 0.9},
                             log_file=tmp_path / "run.log", timeout=1200)
    assert summary["complete"]
    row = json.loads((tmp_path / "liar" / "metrics.json").read_text())["rounds"][0]
    assert row["train-dropped"] == 1 and row["train-clients"] == 1
    assert "'shared-steps' is 1; its data size and the config imply" in " ".join(
        row["dropped-reasons"])


@pytest.mark.deploy
def test_differential_privacy_runs_in_a_deployment(deployment, tmp_path):
    summary = deployment.run({**RUN, "num-rounds": 1, "output-dir": str(tmp_path),
                              "run-name": "private", "local-steps": 2,
                              "dp-clipping-norm": 1.0, "dp-noise-multiplier": 0.1},
                             log_file=tmp_path / "run.log", timeout=1200)
    assert summary["complete"] and summary["dp-epsilon"] > 0
    row = json.loads((tmp_path / "private" / "metrics.json").read_text())["rounds"][0]
    assert row["global-reference-norm"] > 0 and not row["failed"]
    assert "update-norm" in row and "client-update-norms" not in row
    # Under privacy the results do not say who, or how many, took part.
    assert not {"train-clients", "train-dropped", "client-accuracy"} & set(row)
    config = json.loads((tmp_path / "private" / "config.json").read_text())
    assert config["privacy"]["noise-multiplier"] == 0.1


@pytest.mark.deploy
def test_a_held_out_supernode_is_only_evaluated_in_a_deployment(deployment, tmp_path):
    """Partition 1 (the last) is held out: its SuperNode gets evaluation messages only,
    keeps no state, and the run equals the same config in one process."""
    held = deployment.nodes[1]
    offset = len(held.log_text())
    run_config = {**RUN, "num-rounds": 2, "output-dir": str(tmp_path),
                  "run-name": "held-out", "held-out-clients": 1}
    summary = deployment.run(run_config, log_file=tmp_path / "run.log", timeout=1200)
    assert summary["complete"] and 0 <= summary["final-held-out-accuracy"] <= 1
    rounds = json.loads((tmp_path / "held-out" / "metrics.json").read_text())["rounds"]
    assert all(r["train-clients"] == 1 for r in rounds)
    assert all(set(r["client-held-out-accuracy"]) == {"1"} for r in rounds)
    assert all(set(r["client-accuracy"]) == {"0"} for r in rounds)
    node_log = held.log_text()[offset:]
    assert "train message" not in node_log and "evaluate message" in node_log
    assert DurableState(deployment.state_dir(1) / "held-out", "held-out", 1).read(any_run=True) is None
    trained = DurableState(deployment.state_dir(0) / "held-out", "held-out", 0).read(any_run=True)
    assert trained.rounds_trained == 2
    config = json.loads((tmp_path / "held-out" / "config.json").read_text())
    assert config["held-out"]["partition-ids"] == [1]
    # The same config in one process (the simulation's code path) gives the same run.
    local = in_one_process(run_config, tmp_path / "local")
    assert_same_rounds(rounds, local, ("accuracy", "held-out-accuracy", "loss", "train-loss"),
                       rel=1e-6)


def _refused(deployment, node) -> str:
    """Run a SuperNode the SuperLink must refuse; its log, once it exited non-zero
    and the two registered nodes are still the only ones online."""
    node.start()
    try:
        code = node.process.wait(timeout=180)
    finally:
        node.stop()
    assert code != 0
    assert len(deployment.online_nodes()) == 2
    return node.log_text()


@pytest.mark.deploy
def test_supernode_with_an_unregistered_key_is_refused(deployment, tmp_path):
    key = create_node_key(tmp_path, "stranger")
    node = deployment.node_process(0, private_key=key.private_key, log_name="stranger.log")
    log = _refused(deployment, node)
    assert "Failed to activate SuperNode" in log and CONNECTED not in log


@pytest.mark.deploy
def test_insecure_supernode_cannot_join_the_tls_superlink(deployment):
    node = deployment.node_process(1, insecure=True, private_key=None,
                                   log_name="insecure.log",
                                   extra_args=("--max-retries", "3", "--max-wait-time", "60"))
    log = _refused(deployment, node)
    assert "Failed to initialize the connection to the SuperLink" in log
    assert CONNECTED not in log


@pytest.mark.deploy
def test_restarted_supernode_continues_from_its_durable_state(deployment, tmp_path):
    """Node 1 is stopped after its round-1 training reply and restarted at once."""
    offsets = {i: len(deployment.nodes[i].log_text()) for i in (0, 1)}
    outcome: dict = {}

    def submit():
        try:
            outcome["summary"] = deployment.run(
                {**RUN, "num-rounds": 3, "output-dir": str(tmp_path), "run-name": "restart"},
                log_file=tmp_path / "run.log", timeout=1500)
        except BaseException as error:  # re-raised in the test thread
            outcome["error"] = error

    runner = threading.Thread(target=submit, daemon=True)
    runner.start()
    node = deployment.nodes[1]
    assert node.wait_for_log("Sending: train message", 900, after=offsets[1])
    sent_at = node.log_text().index("Sending: train message", offsets[1])
    assert node.wait_for_log("Sent successfully", 120, after=sent_at)
    deployment.stop_node(1)
    restarted = deployment.start_node(1, log_name="node-1-restarted.log")
    deployment.wait_connected(1)
    runner.join(timeout=1800)
    assert not runner.is_alive(), "the run did not finish"
    if "error" in outcome:
        raise outcome["error"]

    rounds = json.loads((tmp_path / "restart" / "metrics.json").read_text())["rounds"]
    assert len(rounds) == 3 and rounds[-1]["train-clients"] == 2
    after_restart = restarted.log_text()
    trained_after = after_restart.count("Sending: train message")
    assert trained_after >= 1
    assert "was lost" not in after_restart
    # Node 0 is never disturbed, so node 1's reply went into a round's aggregate
    # exactly when that round has two training clients. Whether its round-1 reply,
    # sent just before the stop, still reached the server depends on timing: when it
    # did, the restarted node must have committed the round-1 state it saved before
    # the stop; when not, discarded it. Either way its rounds are the accepted ones:
    # in its last reply (min-rounds-trained) and in its file.
    accepted = sum(1 for r in rounds if r["train-clients"] == 2)
    assert accepted in (trained_after, trained_after + 1)
    assert rounds[-1]["min-rounds-trained"] == accepted
    saved = DurableState(deployment.state_dir(1) / "restart", "restart", 1).read(any_run=True)
    assert saved.rounds_trained == accepted


@pytest.mark.deploy
def test_a_killed_superlink_resumes_the_run_from_its_checkpoint(deployment, tmp_path):
    """The SuperLink (with its ServerApp) is killed after round 2 of 4 and restarted;
    the run, resubmitted with resume = true, continues from its checkpoint."""
    run_config = {**RUN, "num-rounds": 4, "output-dir": str(tmp_path), "run-name": "resumed"}
    run_dir = tmp_path / "resumed"
    outcome: dict = {}

    def submit():
        try:
            outcome["summary"] = deployment.run(run_config, log_file=tmp_path / "first.log",
                                                timeout=1500)
        except BaseException as error:  # the kill makes this run fail
            outcome["error"] = error

    first = threading.Thread(target=submit, daemon=True)
    first.start()
    deadline = time.monotonic() + 900
    while _rounds(run_dir) < 2:
        assert first.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.5)
    deployment.restart_superlink()
    first.join(timeout=300)
    assert not first.is_alive() and "error" in outcome  # that submission died with it
    assert _rounds(run_dir) == 2
    deadline = time.monotonic() + 300
    while len(deployment.online_nodes()) < 2:
        assert time.monotonic() < deadline, "the SuperNodes did not reconnect"
        time.sleep(2)

    summary = deployment.run({**run_config, "resume": True}, log_file=tmp_path / "second.log",
                             timeout=1500)
    assert summary["complete"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resumed-after-round"] in (2, 3)  # 3: round 3's aggregation was saved
    # The uninterrupted run of the same config, in one process.
    whole = in_one_process(run_config, tmp_path / "local")
    resumed = json.loads((run_dir / "metrics.json").read_text())["rounds"]
    assert [(r["round"], r["accuracy"], r["client-accuracy"]) for r in resumed] == \
        [(r["round"], r["accuracy"], r["client-accuracy"]) for r in whole]
    assert_same_rounds(resumed, whole, ("loss", "train-loss"), rel=1e-3)


def _rounds(run_dir: Path) -> int:
    try:
        return len(json.loads((run_dir / "metrics.json").read_text())["rounds"])
    except (OSError, ValueError, KeyError):
        return 0
