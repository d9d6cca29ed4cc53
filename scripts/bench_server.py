"""The server's work between a round's last training reply and its next message.

While the server checks and aggregates a round's replies, the clients wait: this is
the part of the simulation's fixed cost per round that is the app's own code. The
script feeds the project's strategy (FedSPC or PersonalizedFedAvg, as the ServerApp
builds it for the method) ``--clients`` replies of the model's shared block a round
(the broadcast plus a small random update, so that every check passes), for
``--rounds`` rounds, and times ``aggregate_train`` (which checks every reply, decodes
it, averages, computes the drift diagnostics and, with FedSPC, updates u_bar) and
its parts (the schema check of every reply, the mean, the drift diagnostics, each
alone on the same replies), each in CPU and wall milliseconds per round, median and
range over the rounds after the first.

    python scripts/bench_server.py                              # cnn: fedavg, fedrep +fedspc
    python scripts/bench_server.py --model resnet34 --width 0.25 --methods fedrep
    python scripts/bench_server.py --upload explicit --json out.json

Figures depend on the machine and its load; compare two versions of the code on the
same machine, one after the other (CPU time holds better than wall time under load).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedspc_app.core.config import RunConfig
from fedspc_app.core.correction import reference_change, shared_update
from fedspc_app.core.methods import get_method
from fedspc_app.core.records import from_record
from fedspc_app.models.networks import build_model
from fedspc_app.models.split import parameter_split
from fedspc_app.server_app import build_strategy
from strategies.aggregation import mean_arrays
from strategies.drift import drift_statistics


class Grid:
    """The node ids a strategy samples from (node n holds partition n - 1)."""

    def __init__(self, clients: int) -> None:
        self.nodes = list(range(1, clients + 1))

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def timed(function: Callable[..., object], *args: object) -> tuple[object, float, float]:
    """``function(*args)``, its CPU and wall milliseconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = function(*args)
    return out, (time.process_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3


def replies_for(server, sent: dict[int, Message], broadcast: dict[str, np.ndarray],
                rng: np.random.Generator, steps: int, learning_rate: float,
                upload: str) -> list[Message]:
    """One honest-looking training reply per message: the broadcast shared block plus
    a small update (floating keys), with the metrics an honest client sends."""
    out = []
    for node, message in sent.items():
        final = {key: (value + rng.standard_normal(value.shape, np.float32) * np.float32(1e-3)
                       if np.issubdtype(value.dtype, np.floating) else value.copy())
                 for key, value in broadcast.items()}
        content = RecordDict({
            "arrays": ArrayRecord({k: Array(np.require(v, requirements="C"))
                                   for k, v in final.items()}),
            "metrics": MetricRecord({"num-examples": 500, "shared-steps": steps,
                                     "partition-id": node - 1, "train-loss": 1.0})})
        if upload == "explicit" and getattr(server, "global_reference", None) is not None:
            update = shared_update(final, broadcast, server.corrected_keys)
            change = reference_change(update, server.global_reference, steps=steps,
                                      learning_rate=learning_rate)
            content["reference-change"] = ArrayRecord({k: Array(v) for k, v in change.items()})
        out.append(Message(content, reply_to=message))
    return out


def measure(model: str, width: float, method_name: str, fedspc: bool, clients: int,
            rounds: int, upload: str, seed: int) -> dict:
    """Per-round timings of one configuration."""
    config = RunConfig(method=method_name, fedspc=fedspc, fedspc_upload=upload,
                       model=model, model_width=width, seed=seed)
    method = get_method(method_name)
    network = build_model(model, num_classes=100, seed=seed, width=width)
    split = parameter_split(network, method)
    state = network.state_dict()
    broadcast = {k: state[k].detach().numpy().copy() for k in split.shared}
    server = build_strategy(config, method, split, num_clients=clients)
    grid = Grid(clients)
    for node in grid.nodes:
        server.sampler.bind(node, node - 1)
    rng = np.random.default_rng(seed)
    steps, rows = 10, []
    for server_round in range(1, rounds + 2):
        sent = {m.metadata.dst_node_id: m for m in server.configure_train(
            server_round, ArrayRecord({k: Array(v) for k, v in broadcast.items()}),
            ConfigRecord(), grid)}
        replies = replies_for(server, sent, broadcast, rng, steps, config.learning_rate,
                              upload)
        # The parts, on the same replies, before the strategy sees them.
        _, check_cpu, check_wall = timed(
            lambda schema, replies: [schema.check(r) for r in replies],
            server.reply_schema(), replies)
        finals = [from_record(r.content.array_records["arrays"]) for r in replies]
        weights = [1.0] * len(finals)
        _, mean_cpu, mean_wall = timed(mean_arrays, finals, weights)
        _, drift_cpu, drift_wall = timed(drift_statistics, broadcast, finals, weights,
                                         server.update_keys())
        result, total_cpu, total_wall = timed(server.aggregate_train, server_round, replies)
        arrays, _ = result
        if arrays is None:
            raise SystemExit(f"round {server_round} failed: {server.report.reasons}")
        broadcast = {k: arrays[k].numpy() for k in split.shared}
        rows.append({"aggregate-train": (total_cpu, total_wall),
                     "schema-check": (check_cpu, check_wall),
                     "mean": (mean_cpu, mean_wall),
                     "drift": (drift_cpu, drift_wall)})
    steady = rows[1:]
    parameters = sum(int(v.size) for k, v in broadcast.items())
    out = {"model": model, "width": width, "method": method_name, "fedspc": fedspc,
           "upload": upload, "clients": clients, "rounds": rounds,
           "shared-parameters": parameters, "milliseconds": {}}
    for part in steady[0]:
        for index, clock in enumerate(("cpu", "wall")):
            values = [row[part][index] for row in steady]
            out["milliseconds"][f"{part}-{clock}"] = {
                "median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--width", type=float, default=1.0, help="run-config model-width")
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fedrep"])
    parser.add_argument("--fedspc", choices=("both", "on", "off"), default="both")
    parser.add_argument("--upload", choices=("derived", "explicit"), default="derived")
    parser.add_argument("--clients", type=int, default=10, help="replies a round")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    # Messages outside a running Flower app (as the tests' task_identity fixture does).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    switches = {"both": (False, True), "on": (True,), "off": (False,)}[args.fedspc]
    results = []
    for method in args.methods:
        for fedspc in switches:
            if method == "scaffold" and not fedspc:
                continue
            row = measure(args.model, args.width, method, fedspc, args.clients,
                          args.rounds, args.upload, args.seed)
            results.append(row)
            name = method + ("+fedspc" if fedspc and method != "scaffold" else "")
            ms = row["milliseconds"]
            parts = "  ".join(
                f"{part} {ms[part + '-cpu']['median']:.1f}"
                for part in ("schema-check", "mean", "drift"))
            print(f"{name:16s} {row['shared-parameters']:>10,d} shared, {args.clients} "
                  f"replies: aggregate_train {ms['aggregate-train-cpu']['median']:.1f} ms CPU "
                  f"({ms['aggregate-train-cpu']['min']:.1f}-"
                  f"{ms['aggregate-train-cpu']['max']:.1f}), "
                  f"{ms['aggregate-train-wall']['median']:.1f} ms wall | parts (CPU ms): "
                  f"{parts}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
