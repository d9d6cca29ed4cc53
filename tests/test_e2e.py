"""End to end through ``flwr run``: a SuperLink, Flower's Ray simulation engine, the app.

One private SuperLink (free port, temporary FLWR_HOME, runtime dependency
installation off) serves every run of this module and is stopped by PID at the end.
"""

from __future__ import annotations

import json
import math
import os
import statistics

import numpy as np
import pytest

from fedspc_app.launch.superlink import LocalSuperLink, flwr_run, run_simulation

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    link = LocalSuperLink(tmp_path_factory.mktemp("flwr-home"))
    link.start()
    pid = link.process.pid
    yield link
    link.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the SuperLink is gone


def test_fedavg_on_digits_writes_metrics(superlink, tmp_path):
    log = tmp_path / "run.log"
    summary = run_simulation(
        {"num-rounds": 3, "local-epochs": 1, "output-dir": str(tmp_path), "run-name": "fedavg"},
        superlink=superlink, clients=10, client_cpus=1, log_file=log, timeout=600)
    run_dir = tmp_path / "fedavg"
    assert summary["complete"] and summary["rounds"] == 3
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rounds = metrics["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(len(r["client-accuracy"]) == 10 for r in rounds)
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"]  # it learns
    assert rounds[-1]["accuracy"] > 0.3  # digits, 3 rounds: far above chance (0.1)
    assert all(r["bytes-sent"] > 0 and r["bytes-received"] > 0 for r in rounds)
    # Ray's workers start and load the data during the warm-up, before round 1, while
    # the server prepares (config.json records it). A worker that came up after the
    # others had answered every warm-up query starts in round 1; none later.
    config = json.loads((run_dir / "config.json").read_text())
    warm = config["client-warm-up"]
    assert 0 <= warm["worker-start-seconds"] <= warm["worker-ready-seconds"] <= warm["seconds"]
    # Importing the ClientApp (torch and all) is part of coming up.
    assert 0 < warm["worker-import-seconds"] < warm["worker-ready-seconds"]
    assert warm["worker-imported-seconds"] <= warm["worker-ready-seconds"]
    assert not any(f"{phase}-worker-ready-seconds" in r for r in rounds[1:]
                   for phase in ("train", "evaluate"))
    csv_lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("round,accuracy") and len(csv_lines) == 4
    partition = json.loads((run_dir / "partition.json").read_text())
    assert len(partition["train_counts"]) == 10
    assert config["run-config"]["method"] == "fedavg"
    assert {k: config["precision"][k] for k in ("setting", "resolved", "device")} == {
        "setting": "fp32", "resolved": "fp32", "device": "cpu"}
    # One progress line per round in the streamed log.
    text = log.read_text()
    assert "10 clients, alpha=0.1, 3 rounds, fp32" in text
    assert all(f"round {r}/3" in text for r in (1, 2, 3))


def test_fedrep_with_fedspc_on_digits(superlink, tmp_path):
    summary = run_simulation(
        {"num-rounds": 2, "local-epochs": 1, "method": "fedrep", "fedspc": True,
         "output-dir": str(tmp_path), "run-name": "fedrep-spc"},
        superlink=superlink, clients=4, client_cpus=1, log_file=tmp_path / "run.log",
        timeout=600)
    assert summary["complete"] and summary["method"] == "fedrep+fedspc"
    rounds = json.loads((tmp_path / "fedrep-spc" / "metrics.json").read_text())["rounds"]
    assert rounds[-1]["global-reference-norm"] > 0  # u_bar moved
    # Client state (personal head, u_k) survived between rounds in the simulation.
    assert [r["min-rounds-trained"] for r in rounds] == [1, 2]


def test_bad_input_stops_before_training_and_leaves_nothing(superlink, tmp_path):
    log = tmp_path / "run.log"
    flwr_run(superlink, {"dataset": "cifar100", "data-dir": str(tmp_path / "nowhere"),
                         "download": False, "output-dir": str(tmp_path / "out")},
             clients=2, log_file=log, timeout=300)
    text = log.read_text()
    assert "Run not started" in text and "cifar-100-python" in text
    assert not (tmp_path / "out").exists()


OTHER_CASES = [(m, spc) for m in ("fedavg", "fedprox", "scaffold", "fedper", "fedrep",
                                  "fedbabu", "lgfedavg", "ditto")
               for spc in (False, True)
               if not (m == "scaffold" and spc) and (m, spc) not in {("fedavg", False),
                                                                     ("fedrep", True)}]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "fedspc"), OTHER_CASES)
def test_every_method_runs_in_the_simulation_engine(superlink, tmp_path, method, fedspc):
    """Two rounds of each remaining method, with and without FedSPC, through flwr run."""
    name = f"{method}-{fedspc}"
    summary = run_simulation(
        {"num-rounds": 2, "local-epochs": 1, "ditto-personal-epochs": 1, "method": method,
         "fedspc": fedspc, "alpha": 0.5, "output-dir": str(tmp_path), "run-name": name},
        superlink=superlink, clients=2, client_cpus=1, log_file=tmp_path / "run.log",
        timeout=600)
    assert summary["complete"]
    rounds = json.loads((tmp_path / name / "metrics.json").read_text())["rounds"]
    assert [r["min-rounds-trained"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["clients"] == 2 and len(r["client-accuracy"]) == 2
        assert r["accuracy"] == pytest.approx(statistics.mean(r["client-accuracy"].values()))
    # It learns: every case is at 31% or more in each round (chance 10%) and its test
    # loss falls by 0.25 or more from round 1 to round 2 (measured with these
    # settings; the bounds leave a margin).
    first, last = rounds
    assert first["accuracy"] > 0.2 and last["accuracy"] > 0.2
    assert last["loss"] < first["loss"] - 0.1
    assert last["loss"] < math.log(10)  # better than a uniform guess
    assert ("global-reference-norm" in rounds[-1]) == (fedspc or method == "scaffold")
    if "global-reference-norm" in rounds[-1]:
        assert all(r["global-reference-norm"] > 0 for r in rounds)  # u_bar moved


@pytest.mark.slow
def test_a_robust_rule_a_server_optimizer_and_an_attacker_run_through_flwr_run(
        superlink, tmp_path):
    summary = run_simulation(
        {"num-rounds": 2, "local-epochs": 1, "method": "fedrep", "fedspc": True,
         "aggregation": "trimmed-mean", "trim-fraction": 0.25,
         "server-optimizer": "fedadam", "server-learning-rate": 0.01,
         "attack": "sign-flip", "attack-clients": 1,
         "output-dir": str(tmp_path), "run-name": "robust"},
        superlink=superlink, clients=4, client_cpus=1, log_file=tmp_path / "run.log",
        timeout=600)
    assert summary["complete"]
    run_dir = tmp_path / "robust"
    rounds = json.loads((run_dir / "metrics.json").read_text())["rounds"]
    assert all(r["train-clients"] == 4 and not r["train-dropped"] for r in rounds)
    assert all(r["global-reference-norm"] > 0 for r in rounds)
    recorded = json.loads((run_dir / "config.json").read_text())["run-config"]
    assert (recorded["aggregation"], recorded["server-optimizer"]) == ("trimmed-mean",
                                                                       "fedadam")
    # The optimizer's moments are in the checkpoint, one pair per corrected key.
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text())
    with np.load(run_dir / checkpoint["arrays"]) as arrays:
        names = list(arrays.files)
    moments = [n for n in names if n.startswith("optimizer/")]
    references = [n for n in names if n.startswith("reference/")
                  and not n.startswith("reference/client/")]  # u_bar, not the tracked u_k
    assert len(moments) == 2 * len(references) > 0
    # fedspc-reference "auto" under a robust rule: the client centre, u_k kept.
    assert any(n.startswith("reference/client/") for n in names)


@pytest.mark.slow
def test_differential_privacy_runs_through_flwr_run(superlink, tmp_path):
    summary = run_simulation(
        {"num-rounds": 2, "method": "fedrep", "fedspc": True, "local-steps": 3,
         "dp-clipping-norm": 0.5, "dp-noise-multiplier": 0.1, "fraction-train": 0.5,
         "min-train-replies": 0.5, "output-dir": str(tmp_path), "run-name": "private"},
        superlink=superlink, clients=4, client_cpus=1, log_file=tmp_path / "run.log",
        timeout=600)
    assert summary["complete"] and summary["dp-epsilon"] > 0
    rounds = json.loads((tmp_path / "private" / "metrics.json").read_text())["rounds"]
    # Each client drawn with probability 1/2 from the server's secret; how many were is
    # not written (with colluders' own draws it would tell another's).
    assert len(rounds) == 2 and not [r for r in rounds if "train-clients" in r]
    assert rounds[0]["dp-epsilon"] < rounds[1]["dp-epsilon"]
    assert "ε " in (tmp_path / "run.log").read_text()  # in the progress line
