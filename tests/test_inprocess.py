"""The real ServerApp and ClientApp, every method, run in one process (no Ray).

These tests inspect every message that crosses the (in-process) wire: which keys
it carries, that personalized parameters and local references never appear, and
that the client state persists between rounds. See tests/inprocess.py.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, MessageType, RecordDict
from inprocess import InProcessGrid

from fedspc_app import client_app, server_app
from fedspc_app.core import startup
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.methods import METHODS, get_method
from fedspc_app.core.records import from_record
from fedspc_app.data.datasets import load_dataset
from fedspc_app.models.run_model import initial_model, load_arrays, make_model
from fedspc_app.models.split import parameter_split
from fedspc_app.serial import run_serial
from fedspc_app.training.client_data import client_data, seeded_generator
from fedspc_app.training.loop import evaluate_model, train_epochs
from fedspc_app.training.precision import resolve_device

NUM_CLIENTS = 3
# The cached runs below outlive any one test, so their folder is removed at exit.
OUTPUT = Path(tempfile.mkdtemp(prefix="fedspc-inprocess-"))
atexit.register(shutil.rmtree, OUTPUT, ignore_errors=True)
FORBIDDEN_RECORDS = {"personal", "local-reference", "personal-model", "client-info"}


@functools.cache
def run_app(method: str, fedspc: bool, clients: int = NUM_CLIENTS,
            **overrides) -> tuple[InProcessGrid, dict]:
    """Run two rounds of ``method`` on digits; cached per argument set."""
    run_config = {
        "method": method, "fedspc": fedspc, "num-rounds": 2, "local-epochs": 1,
        "ditto-personal-epochs": 1, "batch-size": 64, "alpha": 0.5,
        "output-dir": str(OUTPUT), "checkpoint": False,  # client state in context.state
        "run-name": f"{method}-{fedspc}-k{clients}-" + "-".join(
            f"{k}{v}" for k, v in sorted(overrides.items())),
        **{key.replace("_", "-"): value for key, value in overrides.items()},
    }
    # A process's first message carries when the process started (bytes no later run
    # carries); spend it here so that every cached run's traffic is comparable,
    # whichever test runs first in this process.
    startup._FIRST_MESSAGE["pending"] = False
    grid = InProcessGrid(client_app.app, clients, run_config)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))
    run_dir = OUTPUT / run_config["run-name"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return grid, metrics


def split_of(method: str):
    config = parse_run_config({"method": method})
    dataset = load_dataset("digits", None)
    return parameter_split(make_model(config, dataset), get_method(method))


def train_messages(grid: InProcessGrid, server_round: int):
    return [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN
            and m.content.config_records["config"]["server-round"] == server_round]


def train_replies(grid: InProcessGrid):
    return [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]


CASES = [(name, spc) for name in METHODS for spc in (False, True)
         if not (spc and (METHODS[name].control_variates or METHODS[name].shared == "none"))]


@pytest.mark.parametrize(("method", "fedspc"), CASES)
def test_messages_carry_only_the_shared_block(method, fedspc):
    grid, metrics = run_app(method, fedspc)
    split = split_of(method)
    corrected = METHODS[method].control_variates or fedspc
    assert len(grid.sent) == 2 * 2 * NUM_CLIENTS  # train + evaluate, two rounds
    # Before them, one warm-up query a client, answered without error.
    assert [m.content.config_records["config"]["query"] for m in grid.queries] == [
        "warm-up"] * NUM_CLIENTS
    assert not any(reply.has_error() for reply in grid.query_replies)
    for message in grid.sent + grid.replies:
        assert not message.has_error(), message.error
        content = message.content
        assert not FORBIDDEN_RECORDS & set(content.keys())
        if "arrays" in content.array_records:
            assert set(content.array_records["arrays"].keys()) == set(split.shared)
        for record in content.array_records.values():
            assert not set(record.keys()) & set(split.personal)
    for message in train_messages(grid, 1) + train_messages(grid, 2):
        has_reference = "global-reference" in message.content.array_records
        assert has_reference == corrected
        if has_reference:
            keys = set(message.content.array_records["global-reference"].keys())
            assert keys == set(split.corrected)
    for message in train_replies(grid):
        assert set(message.content.array_records) == {"arrays"}  # derived upload
    # The results: two evaluated rounds and a complete summary.
    assert [r["round"] for r in metrics["rounds"]] == [1, 2]
    assert metrics["summary"]["complete"] is True
    assert_metrics_are_what_the_clients_reported(grid, metrics)
    # The run learns: on digits (chance 10%) every case is at 40% or more after one
    # round and 44% or more after two today, and the test loss falls by 0.14 or more
    # from round 1 to round 2 (measured on every case; the bounds leave a margin).
    first, last = metrics["rounds"]
    assert first["accuracy"] > 0.25 and last["accuracy"] > 0.3
    assert last["loss"] < first["loss"] - 0.05
    assert last["loss"] < math.log(10)  # better than a uniform guess


def evaluation_replies(grid: InProcessGrid) -> dict[int, dict[int, tuple[int, int, float]]]:
    """round -> partition id -> (correct, examples, loss sum), as the clients replied."""
    out: dict[int, dict[int, tuple[int, int, float]]] = {}
    for message, reply in zip(grid.sent, grid.replies, strict=True):
        if message.metadata.message_type != MessageType.EVALUATE:
            continue
        assert reply.metadata.reply_to_message_id == message.metadata.message_id
        server_round = int(message.content.config_records["config"]["server-round"])
        metrics = reply.content.metric_records["metrics"]
        out.setdefault(server_round, {})[int(metrics["partition-id"])] = (
            int(metrics["correct"]), int(metrics["num-examples"]), float(metrics["loss-sum"]))
    return out


def assert_metrics_are_what_the_clients_reported(grid: InProcessGrid, metrics: dict) -> None:
    """Each round's row in metrics.json: per-client accuracy, their mean, the weighted
    accuracy and the loss all follow from the evaluate replies that crossed the wire."""
    replies = evaluation_replies(grid)
    assert sorted(replies) == [r["round"] for r in metrics["rounds"]]
    for row in metrics["rounds"]:
        reported = replies[row["round"]]
        assert sorted(reported) == list(range(NUM_CLIENTS))
        assert row["clients"] == NUM_CLIENTS
        per_client = {str(pid): correct / n for pid, (correct, n, _) in reported.items()}
        assert row["client-accuracy"] == pytest.approx(per_client)
        assert row["accuracy"] == pytest.approx(np.mean(list(per_client.values())))
        examples = sum(n for _, n, _ in reported.values())
        assert row["weighted-accuracy"] == pytest.approx(
            sum(c for c, _, _ in reported.values()) / examples)
        assert row["loss"] == pytest.approx(sum(loss for *_, loss in reported.values())
                                            / examples)


@pytest.mark.parametrize(("method", "fedspc"), CASES)
def test_client_state_persists_between_rounds(method, fedspc):
    grid, _ = run_app(method, fedspc)
    split = split_of(method)
    spec = METHODS[method]
    for pid in range(NUM_CLIENTS):
        state = grid.state(pid)
        assert state["client-info"]["rounds-trained"] == 2
        if split.personal:
            assert set(state["personal"].keys()) == set(split.personal)
        else:
            assert "personal" not in state
        assert ("personal-model" in state) == spec.personal_model
        if spec.control_variates or fedspc:
            reference = from_record(state["local-reference"])
            assert set(reference) == set(split.corrected)
            assert any(np.any(v != 0) for v in reference.values())
        else:
            assert "local-reference" not in state
    if spec.control_variates or fedspc:
        round2 = from_record(train_messages(grid, 2)[0].content.array_records["global-reference"])
        assert any(np.any(v != 0) for v in round2.values())


def broadcasts(grid: InProcessGrid) -> list[dict]:
    """The shared block the server broadcast for training, round by round, then the
    final one (sent for the last evaluation)."""
    out = [from_record(train_messages(grid, r)[0].content.array_records["arrays"])
           for r in (1, 2)]
    last_eval = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE][-1]
    return out + [from_record(last_eval.content.array_records["arrays"])]


def assert_same_arrays(a: dict, b: dict) -> None:
    """Equal up to the CPU kernels' own rounding noise.

    Two identical runs of the same method in one process already differ by about
    1e-9 after one round (oneDNN/MKL pick kernels by memory alignment), and a
    second round of training amplifies that to up to 5.6e-6 (measured: scaffold
    against fedavg + fedspc, ditto derived against explicit; with atol = 1e-6
    those tests failed about one run in two). A real difference in the algorithm
    (a missing or wrong correction) moves the final parameters by 6e-4 to 4e-3
    (the ``max_difference`` checks below), ten times this tolerance or more.
    """
    assert a.keys() == b.keys()
    for key, value in a.items():
        np.testing.assert_allclose(value, b[key], rtol=1e-5, atol=5e-5, err_msg=key)


def max_difference(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)


def test_fedspc_with_everything_shared_is_scaffold():
    scaffold, scaffold_metrics = run_app("scaffold", False)
    fedavg_spc, fedavg_spc_metrics = run_app("fedavg", True)
    for a, b in zip(broadcasts(scaffold), broadcasts(fedavg_spc)):
        assert_same_arrays(a, b)
    for r in (1, 2):
        assert_same_arrays(
            from_record(train_messages(scaffold, r)[0].content.array_records["global-reference"]),
            from_record(train_messages(fedavg_spc, r)[0].content.array_records["global-reference"]))
    assert [r["accuracy"] for r in scaffold_metrics["rounds"]] == pytest.approx(
        [r["accuracy"] for r in fedavg_spc_metrics["rounds"]], abs=0.01)
    # The comparison has teeth: without the correction the model is elsewhere.
    fedavg, _ = run_app("fedavg", False)
    assert max_difference(broadcasts(fedavg)[2], broadcasts(scaffold)[2]) > 1e-4


@pytest.mark.parametrize("method", ["fedrep", "ditto"])
def test_explicit_and_derived_reference_uploads_agree(method):
    derived, derived_metrics = run_app(method, True)
    explicit, explicit_metrics = run_app(method, True, fedspc_upload="explicit")
    for a, b in zip(broadcasts(derived), broadcasts(explicit)):
        assert_same_arrays(a, b)
    assert_same_arrays(
        from_record(train_messages(derived, 2)[0].content.array_records["global-reference"]),
        from_record(train_messages(explicit, 2)[0].content.array_records["global-reference"]))
    for reply in train_replies(explicit):
        assert set(reply.content.array_records) == {"arrays", "reference-change"}
    # Derived mode uploads exactly what the base method uploads; explicit mode more.
    _, base_metrics = run_app(method, False)
    for row_base, row_derived, row_explicit in zip(base_metrics["rounds"],
                                                   derived_metrics["rounds"],
                                                   explicit_metrics["rounds"]):
        assert row_derived["bytes-received"] == row_base["bytes-received"]
        assert row_explicit["bytes-received"] > row_derived["bytes-received"]
        assert row_derived["bytes-sent"] > row_base["bytes-sent"]  # u_bar goes down


@pytest.mark.parametrize("method", ["fedper", "lgfedavg", "fedbabu"])
def test_first_fedspc_round_equals_the_base_method(method):
    """With u_bar = u_k = 0 the correction is zero, so round 1 is the base method's."""
    base, _ = run_app(method, False)
    corrected, _ = run_app(method, True)
    assert_same_arrays(broadcasts(base)[1], broadcasts(corrected)[1])
    # From round 2 on the correction acts.
    assert max_difference(broadcasts(base)[2], broadcasts(corrected)[2]) > 1e-4


def test_fedbabu_head_stays_at_the_common_initialisation():
    grid, _ = run_app("fedbabu", True)
    config = parse_run_config({"method": "fedbabu"})
    initial = make_model(config, load_dataset("digits", None)).state_dict()
    for pid in range(NUM_CLIENTS):
        personal = from_record(grid.state(pid)["personal"])
        for key, value in personal.items():
            np.testing.assert_array_equal(value, initial[key].numpy())


def test_a_failing_client_does_not_stop_the_round_or_commit_state():
    run_config = {"method": "fedper", "fedspc": True, "num-rounds": 2, "local-epochs": 1,
                  "alpha": 0.5, "output-dir": str(OUTPUT), "run-name": "failing",
                  "checkpoint": False}
    grid = InProcessGrid(client_app.app, NUM_CLIENTS, run_config)
    grid.fail_nodes = {2}
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))
    assert "local-reference" not in grid.state(1)  # node 2 = partition 1
    assert grid.state(0)["client-info"]["rounds-trained"] == 2
    metrics = json.loads((OUTPUT / "failing" / "metrics.json").read_text())
    assert [r["train-clients"] for r in metrics["rounds"]] == [2, 2]


@pytest.mark.parametrize(("method", "fedspc"), CASES)
def test_the_plain_loop_computes_what_the_apps_compute(method, fedspc):
    """fedspc_app.serial (no Flower: the benchmark's baseline) and the apps, every
    client sampled: the same metrics to the last bit, round by round."""
    grid, metrics = run_app(method, fedspc)
    config = parse_run_config(grid.contexts[1].run_config)
    plain = run_serial(config, NUM_CLIENTS, echo=lambda line: None)["rounds"]
    keys = ("accuracy", "weighted-accuracy", "loss", "train-loss", "train-images",
            "client-accuracy")
    assert [{k: r[k] for k in keys} for r in plain] == \
        [{k: r[k] for k in keys} for r in metrics["rounds"]]


@pytest.mark.parametrize(("method", "fedspc"), [("fedrep", True), ("scaffold", False)])
def test_the_plain_loop_weighs_u_bar_as_the_apps_do(method, fedspc):
    """aggregation = "weighted": u_bar (SCAFFOLD's c) moves by the count times the
    weighted mean of the changes in both, so round 2, trained with it, agrees."""
    grid, metrics = run_app(method, fedspc, aggregation="weighted")
    config = parse_run_config(grid.contexts[1].run_config)
    plain = run_serial(config, NUM_CLIENTS, echo=lambda line: None)["rounds"]
    keys = ("accuracy", "loss", "train-loss", "client-accuracy")
    assert [{k: r[k] for k in keys} for r in plain] == \
        [{k: r[k] for k in keys} for r in metrics["rounds"]]


def test_the_plain_loop_in_worker_processes_computes_what_it_computes_in_one():
    """``workers`` > 1 (the benchmark's process-parallel baseline) moves the client
    calls to spawned one-thread processes and nothing else: Ditto + FedSPC (client
    state and both references travel to the workers and back) gives the same rows.
    One thread here too: a loss reduced on two threads may differ in its last bit.
    On CUDA the spawned workers need deterministic kernels as this process has them
    (tests/conftest.py)."""
    import torch

    threads = torch.get_num_threads()
    grid, _ = run_app("ditto", True)
    config = parse_run_config({**grid.contexts[1].run_config,
                               "deterministic": torch.cuda.is_available()})
    keys = ("accuracy", "loss", "train-loss", "train-images", "client-accuracy")
    torch.set_num_threads(1)
    try:
        one, two = (run_serial(config, NUM_CLIENTS, echo=lambda line: None,
                               workers=w)["rounds"] for w in (1, 2))
    finally:
        torch.set_num_threads(threads)
    assert [{k: r[k] for k in keys} for r in two] == [{k: r[k] for k in keys} for r in one]


@pytest.mark.parametrize("method", ["fedrep", "lgfedavg"])
def test_accuracy_before_aggregation_is_the_trained_model_of_each_client(method):
    """With one client the average is its own shared block, so the accuracy before
    aggregation must equal the one after; with three it is reported per client."""
    _, alone = run_app(method, True, clients=1, evaluate_before_aggregation=True)
    for row in alone["rounds"]:
        assert row["accuracy-before-aggregation"] == row["accuracy"]
    _, metrics = run_app(method, True, evaluate_before_aggregation=True)
    row = metrics["rounds"][-1]
    assert set(row["client-accuracy-before-aggregation"]) == {"0", "1", "2"}
    assert row["accuracy-before-aggregation"] != row["accuracy"]


def test_local_clients_train_alone_and_send_no_parameter():
    """Method ``local``: every message's array record is empty, and each client's
    accuracy after two rounds is that of its own model trained alone, round after
    round, on its own batches (recomputed here without the apps)."""
    grid, metrics = run_app("local", False)
    for message in grid.sent + grid.replies:
        assert all(len(record) == 0 for record in message.content.array_records.values())
    assert "update-norm" not in metrics["rounds"][-1]  # nothing shared: no drift
    config = parse_run_config({**grid.contexts[1].run_config})
    reported = evaluation_replies(grid)[2]
    for k in range(NUM_CLIENTS):
        data = client_data(config, k, NUM_CLIENTS)
        model = initial_model(config, data.dataset)
        for server_round in (1, 2):
            train_epochs(model, data.batches("train", seeded_generator(config.seed,
                                                                       server_round, k,
                                                                       "train")),
                         epochs=config.local_epochs,
                         trainable=[name for name, _ in model.named_parameters()],
                         **config.step_options)
        correct, examples, _ = evaluate_model(model, data.batches("test")())
        assert (correct, examples) == reported[k][:2]


def test_ditto_evaluates_the_received_global_model_on_request():
    """``evaluate-global-model``: each client's ``client-global-accuracy`` is the
    received global model on its test split, computed here independently from the
    evaluation messages; training and the personal models' accuracy are unchanged."""
    _, plain = run_app("ditto", True)
    grid, metrics = run_app("ditto", True, evaluate_global_model=True)
    same = ("accuracy", "loss", "train-loss", "client-accuracy", "drift-dispersion")
    for with_it, without in zip(metrics["rounds"], plain["rounds"], strict=True):
        assert {k: with_it[k] for k in same} == {k: without[k] for k in same}
    config = parse_run_config(grid.contexts[1].run_config)
    dataset = load_dataset("digits", None)
    for row in metrics["rounds"]:
        evaluations = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE
                       and m.content.config_records["config"]["server-round"] == row["round"]]
        sent = from_record(evaluations[0].content.array_records["arrays"])
        model = make_model(config, dataset).to(resolve_device(config))
        load_arrays(model, sent)
        expected = {}
        for k in range(NUM_CLIENTS):
            correct, examples, _ = evaluate_model(
                model, client_data(config, k, NUM_CLIENTS).batches("test")())
            expected[str(k)] = correct / examples
        assert row["client-global-accuracy"] == pytest.approx(expected, abs=1e-12)
        assert row["global-accuracy"] == pytest.approx(np.mean(list(expected.values())))
        assert row["global-accuracy"] != row["accuracy"]


def test_a_method_without_a_personal_model_ignores_evaluate_global_model():
    _, plain = run_app("fedrep", True)
    _, metrics = run_app("fedrep", True, evaluate_global_model=True)
    for with_it, without in zip(metrics["rounds"], plain["rounds"], strict=True):
        assert "global-accuracy" not in with_it and "client-global-accuracy" not in with_it
        assert with_it["client-accuracy"] == without["client-accuracy"]


def test_only_a_process_first_message_reports_when_the_process_and_handler_started(
        monkeypatch):
    monkeypatch.setitem(startup._FIRST_MESSAGE, "pending", True)
    first = client_app.first_message_times(123.0)
    assert first["handler-started-at"] == 123.0
    assert first["process-started-at"] <= time.time()
    # This process imported the package, then the ClientApp module, before now.
    assert (first["process-started-at"] <= first["app-import-started-at"]
            <= first["app-imported-at"] <= time.time())
    assert client_app.first_message_times(456.0) == {}


def test_a_process_start_is_never_reported_after_the_apps_import(monkeypatch):
    # The boot clock and a wall clock stepped since disagree: the estimate is capped.
    monkeypatch.setitem(startup._FIRST_MESSAGE, "pending", True)
    monkeypatch.setattr(startup, "process_started_at", lambda: 1e12)
    first = startup.first_message_times(30.0, import_started_at=10.0, imported_at=20.0)
    assert first["process-started-at"] == 10.0


def test_a_process_start_is_read_as_a_wall_clock_epoch():
    import subprocess
    import sys

    spawned = time.time()
    child = subprocess.run(
        [sys.executable, "-c", "import fedspc_app.core.startup as s; print(s.process_started_at())"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    # /proc gives the boot time in whole seconds and the start in clock ticks.
    assert abs(float(child.stdout) - spawned) < 2.0


def test_the_warm_up_asks_every_node_once_and_a_failed_node_only_warns(monkeypatch):
    from logging import WARNING

    from fedspc_app.server import warm_up

    grid = InProcessGrid(client_app.app, NUM_CLIENTS, {"output-dir": str(OUTPUT)})
    grid.fail_nodes = {2}
    logged = []
    monkeypatch.setattr(warm_up, "log", lambda level, *args: logged.append((level, args)))
    record = warm_up.finish(grid, warm_up.start(grid, 0), timeout=60.0)
    assert [m.metadata.dst_node_id for m in grid.queries] == [1, 2, 3]
    assert [reply.has_error() for reply in grid.query_replies] == [False, True, False]
    assert not grid.sent and 0 <= record["waited-seconds"] <= record["seconds"] < 60.0
    warnings = [args for level, args in logged if level == WARNING]
    assert len(warnings) == 1 and "failed to warm up" in warnings[0][0]
    assert "node 2 was told to fail" in warnings[0][2]
