"""Exporting a run's trained models (fedspc_app.export) from real run folders.

The runs are the real ServerApp and ClientApp in one process (tests/inprocess.py)
with a checkpoint, so the run folders hold what a simulation writes: the server's
checkpoint and the clients' saved state (``client-state/``). An exported client model
must reproduce, prediction for prediction, the accuracy the run recorded for that
client; the global one must be the checkpoint's shared block.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from inprocess import InProcessGrid

from clients import ClientJob, evaluate_client
from clients.durable import FINAL_MARKER, SIMULATION_FOLDER, DurableState
from clients.state import PENDING, ClientState
from fedspc_app import client_app, server_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.methods import get_method
from fedspc_app.export import (
    ExportError,
    description_path,
    export,
    load_client_model,
    load_global_model,
    main,
    open_run,
)
from fedspc_app.models.networks import build_model
from fedspc_app.models.run_model import make_model, state_arrays
from fedspc_app.models.split import parameter_split
from fedspc_app.runs.checkpoint import CHECKPOINT_JSON
from fedspc_app.training.client_data import client_data
from fedspc_app.training.loop import evaluate_model
from fedspc_app.training.precision import resolve_device

ROOT = Path(__file__).resolve().parent.parent
K = 3
BASE = {"num-rounds": 1, "local-epochs": 1, "ditto-personal-epochs": 1, "batch-size": 64,
        "alpha": 0.5, "checkpoint": True, "keep-client-state": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name, **run_config)``: the folder of a finished run (run once per name)."""
    output = tmp_path_factory.mktemp("runs")
    done: dict[str, Path] = {}

    def run(name: str, **overrides) -> Path:
        if name not in done:
            run_config = {**BASE, **overrides, "output-dir": str(output), "run-name": name}
            server_app.main(InProcessGrid(client_app.app, K, run_config),
                            Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                    run_config=run_config))
            done[name] = output / name
        return done[name]

    return run


@pytest.fixture
def fedper(runs):
    return runs("fedper", method="fedper", fedspc=True)


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / run_dir.name))


def run_config_of(run_dir: Path):
    return parse_run_config(json.loads((run_dir / "config.json").read_text())["run-config"])


def recorded_correct(run_dir: Path, client: int) -> int:
    """Correct test predictions of ``client`` in the run's last evaluated round."""
    rounds = json.loads((run_dir / "metrics.json").read_text())["rounds"]
    accuracy = rounds[-1]["client-accuracy"][str(client)]
    examples = len(client_data(run_config_of(run_dir), client, K).test_indices)
    return round(accuracy * examples)


def correct_of(model: torch.nn.Module, run_dir: Path, client: int) -> int:
    """The exported model (on the CPU) evaluated where the run evaluated it."""
    config = run_config_of(run_dir)
    model.to(resolve_device(config))
    correct, _, _ = evaluate_model(model, client_data(config, client, K).batches("test")(),
                                   **config.compute_options)
    return correct


def shared_block(run_dir: Path) -> dict[str, np.ndarray]:
    name = json.loads((run_dir / CHECKPOINT_JSON).read_text())["arrays"]
    with np.load(run_dir / name) as data:
        return {key.removeprefix("shared/"): data[key] for key in data.files
                if key.startswith("shared/")}


def same_state(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> bool:
    state = model.state_dict()
    return set(state) == set(arrays) and all(
        np.array_equal(state[key].numpy(), arrays[key]) for key in arrays)


# ------------------------------------------------------------------ the models
@pytest.mark.parametrize("client", range(K))
def test_a_client_model_reproduces_the_recorded_accuracy_of_that_client(fedper, client):
    model = load_client_model(fedper, client)
    assert correct_of(model, fedper, client) == recorded_correct(fedper, client)


def test_a_client_model_is_the_shared_block_and_that_clients_own_head(fedper):
    models = [load_client_model(fedper, k) for k in range(K)]
    shared = shared_block(fedper)
    personal = open_run(fedper).split.personal
    assert personal and set(shared).isdisjoint(personal)
    for model in models:
        assert same_state(model, {**shared, **state_arrays(model, personal)})
    heads = [state_arrays(model, personal) for model in models]
    assert not np.array_equal(heads[0][personal[0]], heads[1][personal[0]])


def test_dittos_client_model_is_its_personal_model_and_global_the_servers(runs):
    ditto = runs("ditto", method="ditto")
    for client in range(K):
        model = load_client_model(ditto, client)
        assert correct_of(model, ditto, client) == recorded_correct(ditto, client)
    assert same_state(load_global_model(ditto), shared_block(ditto))
    assert not same_state(load_client_model(ditto, 0), shared_block(ditto))


def test_fedavgs_global_model_is_the_checkpoints_and_every_clients_too(runs, tmp_path):
    fedavg = runs("fedavg", method="fedavg")
    shared = shared_block(fedavg)
    assert same_state(load_global_model(fedavg), shared)
    assert same_state(load_client_model(fedavg, 2), shared)
    assert correct_of(load_global_model(fedavg), fedavg, 1) == recorded_correct(fedavg, 1)
    description = export(fedavg, tmp_path / "client.pt", 2)
    assert description["same-as-global"] is True and "personalizes nothing" in \
        description["contents"]
    assert description["client"] == 2 and description["split"]["personal"] == []


def test_fedbabus_export_is_the_model_before_its_evaluation_fine_tuning(runs, tmp_path):
    fedbabu = runs("fedbabu", method="fedbabu")
    config, method = run_config_of(fedbabu), get_method("fedbabu")
    description = export(fedbabu, tmp_path / "babu.pt", 1)
    assert "before FedBABU's evaluation-time fine-tuning" in description["note"]
    exported = load_client_model(fedbabu, 1)
    split = parameter_split(exported, method)
    # Evaluating it as the run did (fine-tuning a copy first) gives the recorded count.
    job = ClientJob(config, method, make_model(config, client_data(config, 1, K).dataset),
                    split, state_arrays(exported, split.shared),
                    ClientState(personal=state_arrays(exported, split.personal), round=1),
                    client_data(config, 1, K), server_round=1, partition_id=1)
    assert evaluate_client(job).correct == recorded_correct(fedbabu, 1)


# ------------------------------------------------------------------ files and CLI
def test_the_command_writes_the_state_dict_and_its_description(fedper, tmp_path, capsys):
    out = tmp_path / "models" / "client-1.pt"
    assert main([str(fedper), "--client", "1", "--out", str(out)]) == 0
    assert "client 1's model" in capsys.readouterr().out
    description = json.loads(description_path(out).read_text())
    # The description rebuilds the model (docs/trained-models.md), the file fills it.
    model = build_model(description["model"], num_classes=description["num-classes"],
                        in_chans=description["in-chans"],
                        image_size=description["image-size"],
                        width=description["model-width"])
    model.load_state_dict(torch.load(out, weights_only=True))
    assert correct_of(model, fedper, 1) == recorded_correct(fedper, 1)
    assert description_path(out).name == "client-1.pt.json"
    assert {key: description[key] for key in (
        "file", "model", "model-width", "dataset", "num-classes", "method", "label",
        "client", "round", "run-name", "run-complete")} == {
        "file": "client-1.pt", "model": "cnn", "model-width": 1.0, "dataset": "digits",
        "num-classes": 10, "method": "fedper", "label": "fedper+fedspc", "client": 1,
        "round": 1, "run-name": "fedper", "run-complete": True}
    split = open_run(fedper).split
    assert description["split"] == {"shared": list(split.shared),
                                     "personal": list(split.personal)}
    assert sorted(path.name for path in out.parent.iterdir()) == [
        "client-1.pt", "client-1.pt.json"]  # no temporary file left


def test_the_command_exports_the_global_model(runs, tmp_path):
    out = tmp_path / "global.pt"
    assert main([str(runs("fedavg", method="fedavg")), "--global", "--out", str(out)]) == 0
    assert json.loads(description_path(out).read_text())["client"] == "global"
    state = torch.load(out, weights_only=True)
    shared = shared_block(runs("fedavg", method="fedavg"))
    assert all(np.array_equal(state[key].numpy(), shared[key]) for key in shared)


def test_the_module_prints_its_usage():
    done = subprocess.run([sys.executable, "-m", "fedspc_app.export", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower() and "--client-state" in done.stdout


# ------------------------------------------------------------------ the client state
def test_a_client_state_dir_outside_the_run_folder_is_found_from_config_json(runs, fedper):
    state = fedper.parent / "states"  # an absolute client-state-dir beside the runs
    run_dir = runs("fedper-state", method="fedper", fedspc=True,
                   **{"client-state-dir": str(state)})
    path = run_dir / "config.json"
    record = json.loads(path.read_text())
    assert record["run-config"]["client-state-dir"] == "../states"  # no path of this machine
    assert (state / "fedper-state").is_dir() and not (run_dir / "client-state").exists()
    model = load_client_model(run_dir, 1)
    assert correct_of(model, run_dir, 1) == recorded_correct(run_dir, 1)
    record["run-config"]["client-state-dir"] = str(state)  # as config.json recorded it before
    path.write_text(json.dumps(record))
    assert same_state(load_client_model(run_dir, 1),
                      {key: value.numpy() for key, value in model.state_dict().items()})


def test_a_pending_state_the_server_aggregated_is_used(fedper, tmp_path):
    run_dir = copy_run(fedper, tmp_path)
    folder = run_dir / SIMULATION_FOLDER
    (folder / "partition-1.npz").rename(folder / "partition-1.pending.npz")
    assert correct_of(load_client_model(run_dir, 1), run_dir, 1) == recorded_correct(fedper, 1)


def test_a_pending_state_of_a_round_never_aggregated_is_ignored(fedper, tmp_path):
    run_dir = copy_run(fedper, tmp_path)
    folder = run_dir / SIMULATION_FOLDER
    store = DurableState(folder, "fedper", 1, DurableState(folder, "fedper", 1).token_of())
    committed = store.read()
    zeroed = {key: np.zeros_like(value) for key, value in committed.personal.items()}
    store.write(ClientState(personal=zeroed, round=2, rounds_trained=2), PENDING)
    assert correct_of(load_client_model(run_dir, 1), run_dir, 1) == recorded_correct(fedper, 1)
    store.write(ClientState(personal=zeroed, round=0))  # the committed state too: no match
    with pytest.raises(ExportError, match=r"aggregated client 1's training in round 1, "
                                          r"but its saved state is from another round"):
        load_client_model(run_dir, 1)


def test_a_state_of_the_right_round_written_by_another_run_is_refused(fedper, tmp_path):
    # Another run of the same name (another run token) left a round-1 state here.
    run_dir = copy_run(fedper, tmp_path)
    store = DurableState(run_dir / SIMULATION_FOLDER, "fedper", 1)
    assert store.token_of() not in (None, "")
    committed = store.read(any_run=True)
    zeroed = {key: np.zeros_like(value) for key, value in committed.personal.items()}
    DurableState(store.directory, "fedper", 1, run_token="0" * 16).write(
        ClientState(personal=zeroed, round=committed.round, rounds_trained=1))
    with pytest.raises(ExportError, match=r"partition-1\.npz \(round 1, written by another "
                                          r"run of this name\)"):
        load_client_model(run_dir, 1)


def test_a_deployments_client_state_is_read_from_a_copied_state_dir(fedper, tmp_path):
    run_dir = copy_run(fedper, tmp_path)
    record = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**record, "runtime": "deployment"}))
    state_dir = tmp_path / "supernode-state"
    shutil.move(run_dir / SIMULATION_FOLDER, state_dir / "fedper")
    out = tmp_path / "out" / "m.pt"
    with pytest.raises(ExportError) as error:
        export(run_dir, out, 2)
    assert "deployment" in str(error.value) and "<state-dir>/fedper/partition-2.npz" in \
        str(error.value) and "--client-state DIR" in str(error.value)
    assert not out.parent.exists()
    assert main([str(run_dir), "--client", "2", "--out", str(out),
                 "--client-state", str(state_dir)]) == 0
    model = load_client_model(run_dir, 2, client_state=state_dir / "fedper")  # either folder
    assert correct_of(model, run_dir, 2) == recorded_correct(fedper, 2)


# ------------------------------------------------------------------ errors
def exports_nothing(run_dir: Path, tmp_path: Path, match: str, **kwargs) -> str:
    """The error ``export`` raises (matching ``match``); nothing is written."""
    out = tmp_path / "out" / "model.pt"
    with pytest.raises(ExportError, match=match) as error:
        export(run_dir, out, **kwargs)
    assert not out.parent.exists()
    return str(error.value)


@pytest.mark.parametrize("make", [lambda tmp: tmp, lambda tmp: tmp / "missing",
                                  lambda tmp: Path(shutil.copy(__file__, tmp / "a.py"))])
def test_a_folder_that_is_no_run_is_refused(tmp_path, make):
    exports_nothing(make(tmp_path), tmp_path, "is not a run folder", client=0)


def test_a_run_without_a_checkpoint_is_refused(runs, tmp_path):
    run_dir = runs("no-checkpoint", method="fedavg", checkpoint=False,
                   **{"keep-client-state": False})
    exports_nothing(run_dir, tmp_path, r"kept no checkpoint \(checkpoint = false\)", client=0)


@pytest.mark.parametrize("client", [-1, K, 10])
def test_a_client_outside_the_run_is_refused(fedper, tmp_path, client):
    exports_nothing(fedper, tmp_path, rf"client {client} is not one of the run's clients: "
                    rf"0..{K - 1} \(num-clients = {K}", client=client)


@pytest.mark.parametrize("method", ["fedper", "ditto"])
def test_a_default_run_keeps_what_its_clients_models_need_and_exports_them(runs, method):
    # FedPer + FedSPC with the default keep-client-state = false, as a new user runs it.
    run_dir = runs(f"{method}-default", method=method, fedspc=True,
                   **{"keep-client-state": False})
    folder = run_dir / SIMULATION_FOLDER
    assert (folder / FINAL_MARKER).is_file()
    for path in folder.glob("partition-*.npz"):
        with np.load(path) as data:  # no u_k: only what the models need
            assert not [n for n in data.files if n.startswith("local-reference/")]
            assert [n for n in data.files if n.startswith(("personal/", "personal-model/"))]
    for client in range(K):
        model = load_client_model(run_dir, client)
        assert correct_of(model, run_dir, client) == recorded_correct(run_dir, client)


def test_the_global_model_of_a_partial_split_is_refused(fedper, tmp_path, capsys):
    text = exports_nothing(fedper, tmp_path, "shares only part of the model", client=None)
    assert "head.weight" in text and "--client K" in text
    out = tmp_path / "out" / "global.pt"
    assert main([str(fedper), "--global", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("fedspc: fedper+fedspc shares only part")
    assert not out.parent.exists()
