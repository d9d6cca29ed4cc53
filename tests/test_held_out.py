"""Held-out clients (``held-out-clients``): clients that never train, tested as new
clients after fine-tuning from the shared block (clients/held_out.py).

The in-process runs use the real ServerApp and ClientApp (tests/inprocess.py) and
inspect every message: held-out clients get evaluation messages only, their data
never reaches training, the aggregate is bit for bit that of a run of the training
clients alone, and their fine-tuning changes nothing but the personalized part.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, MessageType, RecordDict
from inprocess import InProcessGrid, run_server

from clients import held_out as held_out_module
from clients.held_out import evaluate_new_client, fine_tuned_keys
from clients.local import ClientJob
from clients.state import ClientState
from fedspc_app import client_app, server_app
from fedspc_app.core import startup
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import get_method
from fedspc_app.core.protocol import HELD_OUT, METRICS, NUM_EXAMPLES, PARTITION_ID
from fedspc_app.core.records import from_record
from fedspc_app.data import run_data
from fedspc_app.data.partition import Partition, make_partition
from fedspc_app.data.partition_files import save_partition
from fedspc_app.data.run_data import held_out_ids, hold_out
from fedspc_app.experiments.records import ResultRecord
from fedspc_app.experiments.reports import runs_table, table1, table3
from fedspc_app.models.run_model import initial_model, load_arrays, state_arrays
from fedspc_app.models.split import parameter_split
from fedspc_app.training.client_data import client_data, seeded_generator
from fedspc_app.training.loop import evaluate_model, train_epochs
from strategies.sampling import PartitionSampler

TOTAL, HELD = 6, 2
OUTPUT = Path(tempfile.mkdtemp(prefix="fedspc-held-out-"))
atexit.register(shutil.rmtree, OUTPUT, ignore_errors=True)


def run_config(method: str, fedspc: bool, name: str, **overrides) -> dict:
    return {"method": method, "fedspc": fedspc, "num-rounds": 2, "local-epochs": 1,
            "ditto-personal-epochs": 1, "alpha": 0.5, "output-dir": str(OUTPUT),
            "checkpoint": False, "run-name": name,
            **{key.replace("_", "-"): value for key, value in overrides.items()}}


@functools.cache
def held_out_run(method: str, fedspc: bool, **overrides) -> tuple[InProcessGrid, dict]:
    """Two rounds of ``method`` on digits over 6 clients, the last 2 held out."""
    name = f"{method}-{fedspc}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    config = run_config(method, fedspc, name, held_out_clients=HELD, **overrides)
    startup._FIRST_MESSAGE["pending"] = False
    grid = InProcessGrid(client_app.app, TOTAL, config)
    assert run_server(grid, config) is None
    return grid, json.loads((OUTPUT / name / "metrics.json").read_text())


def messages(grid: InProcessGrid, kind: str, node: int | None = None):
    return [m for m in grid.sent if m.metadata.message_type == kind
            and (node is None or m.metadata.dst_node_id == node)]


def nodes_of(partitions) -> set[int]:
    return {p + 1 for p in partitions}  # InProcessGrid: partition i on node i + 1


# ------------------------------------------------------------------ partition
def test_the_held_out_clients_are_a_seeded_draw_moved_to_the_end():
    labels = np.repeat(np.arange(10), 30)
    full = make_partition("dirichlet", labels, labels, num_clients=TOTAL, alpha=0.5,
                          classes_per_client=None, seed=3, num_classes=10)
    held = held_out_ids(TOTAL, HELD, 3)
    assert held == held_out_ids(TOTAL, HELD, 3) and len(set(held)) == HELD
    assert held != held_out_ids(TOTAL, HELD, 4) or held != held_out_ids(TOTAL, HELD, 5)
    moved = hold_out(full, HELD)
    order = [k for k in range(TOTAL) if k not in held] + held
    assert moved.held_out == HELD and moved.num_clients == TOTAL
    for new, old in enumerate(order):
        assert np.array_equal(moved.client(new)[0], full.client(old)[0])
        assert np.array_equal(moved.client(new)[1], full.client(old)[1])
        assert np.array_equal(moved.train_counts()[new], full.train_counts()[old])
        assert np.array_equal(moved.proportions[:, new], full.proportions[:, old])
    assert hold_out(full, 0) is full
    with pytest.raises(ConfigError, match="leaves no client to train"):
        hold_out(full, TOTAL)


def test_the_partition_file_says_which_clients_are_held_out(tmp_path):
    labels = np.repeat(np.arange(10), 30)
    partition = hold_out(make_partition("dirichlet", labels, labels, num_clients=TOTAL,
                                        alpha=0.5, classes_per_client=None, seed=0,
                                        num_classes=10), HELD)
    save_partition(partition, tmp_path)
    assert json.loads((tmp_path / "partition.json").read_text())["held_out_clients"] == HELD


def test_held_out_settings_are_validated():
    with pytest.raises(ConfigError, match="held-out-clients"):
        parse_run_config({"held-out-clients": 3, "num-clients": 3})
    with pytest.raises(ConfigError, match="held-out-parts"):
        parse_run_config({"held-out-parts": "head"})
    with pytest.raises(ConfigError, match="held-out-epochs"):
        parse_run_config({"held-out-epochs": -1})
    config = run_config("fedrep", False, "too-many", held_out_clients=3)
    assert "leaves no client to train" in run_server(InProcessGrid(client_app.app, 3, config),
                                                     config)


def test_the_sampler_draws_only_the_training_clients_as_a_run_of_them_alone():
    with_held = PartitionSampler(TOTAL, seed=5, held_out=HELD)
    alone = PartitionSampler(TOTAL - HELD, seed=5)
    for server_round in range(1, 20):
        for fraction in (0.3, 0.5, 1.0):
            drawn = with_held.draw(server_round, fraction, "train")
            assert drawn == alone.draw(server_round, fraction, "train")
            assert max(drawn) < TOTAL - HELD


# ------------------------------------------------------------------ the apps
@pytest.mark.parametrize(("method", "fedspc"), [("fedrep", True), ("ditto", False),
                                                ("local", False)])
def test_held_out_clients_never_train_and_are_evaluated_as_new_clients(method, fedspc):
    grid, metrics = held_out_run(method, fedspc)
    training, held = range(TOTAL - HELD), range(TOTAL - HELD, TOTAL)
    train = messages(grid, MessageType.TRAIN)
    assert {m.metadata.dst_node_id for m in train} == nodes_of(training)
    for node in nodes_of(held):
        evaluations = messages(grid, MessageType.EVALUATE, node)
        assert len(evaluations) == 2  # one per evaluated round
        assert all(m.content.config_records["config"][HELD_OUT] for m in evaluations)
        assert len(grid.contexts[node].state) == 0  # nothing kept
    for node in nodes_of(training):
        assert not any(HELD_OUT in m.content.config_records["config"]
                       for m in messages(grid, MessageType.EVALUATE, node))
    # The held-out clients' data never reaches training: the replies' images are
    # exactly the training clients' partitions.
    config = parse_run_config(grid.contexts[1].run_config)
    partition = run_data.load_partition(config, TOTAL)
    train_replies = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    assert {m.content.metric_records[METRICS][PARTITION_ID] for m in train_replies} == \
        set(training)
    for reply in train_replies:
        pid = reply.content.metric_records[METRICS][PARTITION_ID]
        assert reply.content.metric_records[METRICS][NUM_EXAMPLES] == \
            len(partition.client(pid)[0])
    for row in metrics["rounds"]:
        assert set(row["client-accuracy"]) == {str(p) for p in training}
        assert set(row["client-held-out-accuracy"]) == {str(p) for p in held}
    # held-out-accuracy is the mean over held-out clients of correct / examples.
    last = [m for m in grid.replies if m.metadata.message_type == MessageType.EVALUATE
            and m.content.metric_records[METRICS].get(HELD_OUT)][-HELD:]
    counts = [(m.content.metric_records[METRICS]["correct"],
               m.content.metric_records[METRICS][NUM_EXAMPLES]) for m in last]
    assert metrics["rounds"][-1]["held-out-accuracy"] == \
        pytest.approx(np.mean([c / n for c, n in counts]), abs=1e-12)
    assert metrics["summary"]["final-held-out-accuracy"] == \
        metrics["rounds"][-1]["held-out-accuracy"]


def restricted(partition: Partition, count: int) -> Partition:
    """The first ``count`` clients of ``partition``, as a partition of their own."""
    return dataclasses.replace(
        partition, num_clients=count, held_out=0,
        train_indices=partition.train_indices[:count],
        test_indices=partition.test_indices[:count],
        proportions=partition.proportions[:, :count],
        _train_counts=partition.train_counts()[:count],
        _test_counts=partition.test_counts()[:count])


@pytest.mark.parametrize(("method", "fedspc", "fraction"), [("fedrep", True, 1.0),
                                                            ("fedper", False, 0.5)])
def test_the_aggregate_is_bit_for_bit_that_of_the_training_clients_alone(
        monkeypatch, method, fedspc, fraction):
    """A run with 2 held-out clients of 6 and a run of its 4 training clients alone
    (same data, same partition ids): the same broadcast shared block and u_bar in
    every round, to the last bit."""
    grid, _ = held_out_run(method, fedspc, fraction_train=fraction)
    config = parse_run_config(grid.contexts[1].run_config)
    alone = restricted(run_data.load_partition(config, TOTAL), TOTAL - HELD)
    monkeypatch.setattr(run_data, "_partition", lambda *args, **kwargs: alone)
    name = f"alone-{method}-{fedspc}-{fraction}"
    plain = run_config(method, fedspc, name, fraction_train=fraction)
    startup._FIRST_MESSAGE["pending"] = False
    other = InProcessGrid(client_app.app, TOTAL - HELD, plain)
    assert run_server(other, plain) is None

    def broadcasts(g):  # sent longest client first, an order that follows timings
        return sorted(((m.content.config_records["config"]["server-round"],
                        m.metadata.dst_node_id,
                        {name: from_record(record)
                         for name, record in m.content.array_records.items()})
                       for m in messages(g, MessageType.TRAIN)), key=lambda t: t[:2])

    ours, theirs = broadcasts(grid), broadcasts(other)
    assert len(ours) == len(theirs) > 0
    for (server_round, node, arrays), (*where, other_arrays) in zip(ours, theirs):
        assert [server_round, node] == where
        assert arrays.keys() == other_arrays.keys()
        for record in arrays:
            for key, value in arrays[record].items():
                assert np.array_equal(value, other_arrays[record][key]), (record, key)
    final = messages(grid, MessageType.EVALUATE, 1)[-1]
    other_final = messages(other, MessageType.EVALUATE, 1)[-1]
    for key, value in from_record(final.content.array_records["arrays"]).items():
        assert np.array_equal(value, from_record(other_final.content.array_records[
            "arrays"])[key])


def test_a_held_out_client_refuses_to_train_and_its_reply_would_be_dropped():
    grid, _ = held_out_run("fedrep", True)
    train = messages(grid, MessageType.TRAIN, 1)[0]
    with pytest.raises(ConfigError, match="never trains"):
        client_app.app(train, Context(run_id=1, node_id=TOTAL, state=RecordDict(),
                                      node_config={"partition-id": TOTAL - 1,
                                                   "num-partitions": TOTAL},
                                      run_config=grid.contexts[1].run_config))
    from fedspc_app.server_app import build_strategy

    config = parse_run_config(grid.contexts[1].run_config)
    strategy = build_strategy(config, get_method("fedrep"), _split("fedrep"), TOTAL)
    answer = next(m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN)
    answer.content.metric_records[METRICS][PARTITION_ID] = TOTAL - 1
    strategy.broadcast = from_record(train.content.array_records["arrays"])
    # Even from the node bound to the held-out partition.
    assert strategy.sampler.bind(answer.metadata.src_node_id, TOTAL - 1) is None
    assert "held-out client" in strategy.check_reply(answer)


# ------------------------------------------------------------------ fine-tuning
def _split(method: str):
    config = parse_run_config({"method": method})
    return parameter_split(server_app.make_model(config, run_data.KNOWN_SHAPES["digits"]),
                           get_method(method))


@pytest.mark.parametrize(("method", "parts", "trained"), [
    ("fedrep", "auto", "head"), ("lgfedavg", "auto", "body"), ("fedavg", "auto", "none"),
    ("fedavg", "all", "all"), ("ditto", "auto", "all"), ("local", "auto", "all"),
    ("fedbabu", "auto", "all"), ("fedrep", "none", "none"), ("fedper", "personal", "head")])
def test_the_fine_tuning_touches_only_what_held_out_parts_names(monkeypatch, method, parts,
                                                                 trained):
    """The model a held-out client tests: the received shared block where it does not
    fine-tune it, the run's initial personalized entries moved by the fine-tuning."""
    config = parse_run_config({"method": method, "held-out-parts": parts,
                               "held-out-clients": 1})
    split = _split(method)
    data = client_data(config, 2, 3)
    initial = state_arrays(initial_model(config, data.dataset),
                           initial_model(config, data.dataset).state_dict().keys())
    # Another shared block than the initial one: scaled (integer buffers as they are).
    received = {k: initial[k] * 1.05 if initial[k].dtype.kind == "f" else initial[k]
                for k in split.shared}
    tested = {}

    def capture(model, batches, **kwargs):
        tested.update(state_arrays(model, model.state_dict().keys()))
        return evaluate_model(model, batches, **kwargs)

    monkeypatch.setattr(held_out_module, "evaluate_model", capture)
    job = ClientJob(config, get_method(method), initial_model(config, data.dataset), split,
                    received, ClientState(), data, server_round=2, partition_id=2)
    outcome = evaluate_new_client(job)
    assert 0 <= outcome.correct <= outcome.examples == len(data.test_indices)
    keys = set(fine_tuned_keys(get_method(method), config, split))
    expected = {"none": set(), "all": set(split.trainable("all")),
                "head": set(split.trainable("head")), "body": set(split.trainable("body"))}
    assert keys == expected[trained]
    start = {**initial, **received}
    for key in split.parameters:
        moved = not np.array_equal(tested[key], start[key])
        assert moved == (key in keys), key


def test_a_held_out_result_is_what_a_plain_fine_tune_and_test_give():
    """Recomputed without the apps: the last round's shared block, the initial head,
    one epoch of SGD on the head with the held-out generator, the test split."""
    grid, metrics = held_out_run("fedrep", True)
    config = parse_run_config(grid.contexts[1].run_config)
    split = _split("fedrep")
    pid = TOTAL - 1
    final = messages(grid, MessageType.EVALUATE, pid + 1)[-1]
    received = from_record(final.content.array_records["arrays"])
    data = client_data(config, pid, TOTAL)
    model = initial_model(config, data.dataset)
    load_arrays(model, received)
    train_epochs(model, data.batches("train", seeded_generator(config.seed, 2, pid, "held-out")),
                 epochs=1, trainable=split.trainable("head"), **config.step_options)
    correct, examples, _ = evaluate_model(model, data.batches("test")(),
                                          **config.compute_options)
    assert metrics["rounds"][-1]["client-held-out-accuracy"][str(pid)] == correct / examples


# ------------------------------------------------------------------ reports
def test_the_tables_add_held_out_columns_when_runs_have_them():
    def record(method, fedspc, seed, final, held):
        return ResultRecord(name=f"{method}-{fedspc}-{seed}", method=method, fedspc=fedspc,
                            alpha=0.1, seed=seed, setting="cifar100-cnn",
                            dataset="cifar100", status="complete", rounds=20,
                            final_accuracy=final, best_accuracy=final, best_round=20,
                            held_out_accuracy=held)

    records = [record("fedrep", False, 0, 0.40, 0.30), record("fedrep", True, 0, 0.42, 0.27)]
    one = table1(records)
    assert one.columns == ["Method", "α", "cifar100-cnn", "cifar100-cnn held out"]
    assert one.rows[0][3] == "30.00" and one.rows[1][3] == "27.00"
    three = table3(records)
    assert three.columns[-3:] == ["cifar100-cnn held out Base",
                                  "cifar100-cnn held out +FedSPC", "cifar100-cnn held out Δ"]
    assert three.rows[0][-1] == "-3.00" and three.rows[0][4] == "+2.00"
    assert "Held out (%)" in runs_table(records).columns
    assert table1(records, metric="best").columns == ["Method", "α", "cifar100-cnn"]
    plain = [dataclasses.replace(r, held_out_accuracy=None) for r in records]
    assert "Held out (%)" not in runs_table(plain).columns
    assert table3(plain).columns[-1] == "cifar100-cnn Δ"


# ------------------------------------------------------------------ end to end
@pytest.mark.e2e
def test_held_out_clients_a_schedule_and_wandb_through_the_grid_runner(tmp_path):
    """The three features of one run through the grid runner (flwr run, a SuperLink,
    Ray): 1 held-out client of 3, an exponential η, W&B offline; then the report."""
    pytest.importorskip("wandb")
    import csv

    import yaml
    from test_wandb import history

    from fedspc_app.experiments import cli
    from fedspc_app.training.schedule import round_learning_rates

    base = {"method": "fedrep", "fedspc": True, "num-rounds": 3, "local-epochs": 1,
            "alpha": 0.5, "held-out-clients": 1, "lr-schedule": "exponential",
            "lr-decay": 0.5, "wandb": True}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "base": base,
                                    "simulation": {"clients": 3, "client-cpus": 1,
                                                   "timeout": 600}}))
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "out")]) == 0
    grid_dir = tmp_path / "out" / "tiny"
    (run_dir,) = [p for p in grid_dir.iterdir() if (p / "summary.json").is_file()]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["held-out"]["partition-ids"] == [2]
    rows = json.loads((run_dir / "metrics.json").read_text())["rounds"]
    assert [set(r["client-accuracy"]) for r in rows] == [{"0", "1"}] * 3
    assert [set(r["client-held-out-accuracy"]) for r in rows] == [{"2"}] * 3
    with (run_dir / "metrics.csv").open() as handle:
        table = list(csv.DictReader(handle))
    expected = round_learning_rates(parse_run_config(config["run-config"]))
    assert [float(r["learning-rate"]) for r in table] == pytest.approx(expected[:3])
    assert expected[:3] == pytest.approx([0.02, 0.01, 0.005])
    logged = history(run_dir)
    for row in table:
        step = logged[int(row["round"])]
        assert step["accuracy/held-out-accuracy"] == pytest.approx(
            float(row["held-out-accuracy"]), rel=1e-12)
        assert step["schedule/learning-rate"] == pytest.approx(float(row["learning-rate"]))
    assert "held out" in (grid_dir / "report" / "table3.md").read_text().splitlines()[0]


def test_export_gives_the_training_clients_and_explains_a_held_out_one(tmp_path):
    from fedspc_app.export import ExportError, client_model, open_run

    config = {**run_config("fedper", False, "exported", held_out_clients=HELD),
              "checkpoint": True, "output-dir": str(tmp_path), "num-rounds": 1}
    startup._FIRST_MESSAGE["pending"] = False
    assert run_server(InProcessGrid(client_app.app, TOTAL, config), config) is None
    run = open_run(tmp_path / "exported")
    assert client_model(run, 0).description["client-round"] == 1
    with pytest.raises(ExportError, match="held-out client .* never trained"):
        client_model(run, TOTAL - 1)
