"""evaluate-server: the server's whole model on the dataset's official test set after
each evaluated round, and one clear error where there is no whole model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Context, MessageType, RecordDict
from inprocess import InProcessGrid

from fedspc_app import client_app, server_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError, DataError
from fedspc_app.core.methods import get_method
from fedspc_app.core.records import from_record
from fedspc_app.data.batching import iterate_batches
from fedspc_app.data.run_data import load_run_dataset
from fedspc_app.models.run_model import load_arrays, make_model
from fedspc_app.models.split import parameter_split
from fedspc_app.server.evaluation import check_server_evaluation
from fedspc_app.training.loop import evaluate_model

BASE = {"num-rounds": 3, "local-epochs": 1, "batch-size": 64, "alpha": 0.5,
        "evaluate-server": True, "run-name": "run"}


def run(tmp_path, **keys):
    run_config = {**BASE, "output-dir": str(tmp_path), **keys}
    grid = InProcessGrid(client_app.app, 2, run_config)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))
    return grid, run_config, json.loads((tmp_path / "run" / "metrics.json").read_text())


def independent_accuracy(config, arrays) -> tuple[float, float]:
    """The model ``arrays`` make up, on every test image, computed here."""
    dataset = load_run_dataset(config)
    model = make_model(config, dataset)
    load_arrays(model, arrays)
    correct, examples, loss = evaluate_model(model, iterate_batches(
        dataset, "test", np.arange(dataset.num_test), batch_size=100, shuffle=False,
        augment=False, generator=None, device="cpu"))
    assert examples == dataset.num_test
    return correct / examples, loss / examples




@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_the_server_model_is_evaluated_after_each_evaluated_round(tmp_path, method):
    """Rounds 2 and 3 are evaluated (evaluate-every = 2 and the last round): their
    server-accuracy is the model the next round broadcasts (round 2), and the final
    checkpoint's model (round 3), on the whole test set."""
    grid, run_config, metrics = run(tmp_path, method=method, **{"evaluate-every": 2})
    rows = {row["round"]: row for row in metrics["rounds"]}
    assert "server-accuracy" not in rows[1]
    config = parse_run_config(run_config)
    after_round_2 = next(from_record(m.content.array_records["arrays"]) for m in grid.sent
                         if m.metadata.message_type == MessageType.TRAIN
                         and m.content.config_records["config"]["server-round"] == 3)
    checkpoint = json.loads((tmp_path / "run" / "checkpoint.json").read_text())
    with np.load(tmp_path / "run" / checkpoint["arrays"]) as saved:
        after_round_3 = {k[len("shared/"):]: saved[k] for k in saved.files
                         if k.startswith("shared/")}
    for server_round, arrays in ((2, after_round_2), (3, after_round_3)):
        accuracy, loss = independent_accuracy(config, arrays)
        assert rows[server_round]["server-accuracy"] == pytest.approx(accuracy, abs=1e-12)
        assert rows[server_round]["server-loss"] == pytest.approx(loss, rel=1e-5)
        assert rows[server_round]["server-evaluate-seconds"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final-server-accuracy"] == rows[3]["server-accuracy"]
    csv_header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"server-accuracy", "server-loss", "server-evaluate-seconds"} <= set(csv_header)


@pytest.mark.parametrize("method", ["fedrep", "lgfedavg", "local"])
def test_a_method_without_a_whole_server_model_is_refused_before_writing(tmp_path, method):
    with pytest.raises(SystemExit, match="evaluate-server evaluates the server's whole model"):
        run(tmp_path, method=method)
    assert not (tmp_path / "run").exists()


def test_a_server_without_the_test_set_is_refused():
    config = parse_run_config({"evaluate-server": True})
    split = parameter_split(make_model(config, load_run_dataset(config)),
                            get_method("fedavg"))
    with pytest.raises(DataError, match="does not hold the digits test set"):
        check_server_evaluation(config, split, None)
    check_server_evaluation(config.replace(evaluate_server=False), split, None)
    with pytest.raises(ConfigError):
        check_server_evaluation(config, parameter_split(
            make_model(config, load_run_dataset(config)), get_method("fedper")), None)
