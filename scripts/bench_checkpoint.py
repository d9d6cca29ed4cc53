"""What checkpointing costs per round: the server's checkpoint and the clients' state files.

Writes, for a number of rounds, what a run with ``checkpoint = true`` writes: the
server's checkpoint after the aggregation (θ_s, ū and the strategy state) and after
the evaluation, and each client's staged (pending) state and its commit, with the
project's own writers, on arrays of the real model's shapes (random values; no data
and no training). Prints the median milliseconds per round of each part and their
sum as a share of a round of ``--round-seconds``.

    python scripts/bench_checkpoint.py --run-config conf/cpu-cifar100-cnn.toml \\
        --set "method='fedrep' fedspc=true" --clients 10 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from flwr.app import MetricRecord

from clients.durable import SIMULATION_FOLDER, DurableState
from clients.state import PENDING, ClientState
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.methods import get_method
from fedspc_app.core.records import to_record
from fedspc_app.data.run_data import KNOWN_SHAPES
from fedspc_app.launch.runconfig import load_overrides
from fedspc_app.models.run_model import make_model
from fedspc_app.models.split import parameter_split
from fedspc_app.runs.checkpoint import COMPLETE, RoundRecords, fingerprint
from fedspc_app.runs.results import RunRecorder
from fedspc_app.server_app import build_strategy
from strategies.personalized import RoundReport


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", help="preset (TOML)")
    parser.add_argument("--set", default="", help="run-config overrides, \"key=value ...\"")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--round-seconds", type=float, default=24.0,
                        help="a round's wall time to compare with (the CPU preset: 24 s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedspc-bench-ckpt-") as folder:
        overrides = load_overrides(args.run_config, args.set)
        config = parse_run_config({**overrides, "output-dir": folder, "run-name": "bench",
                                   "checkpoint": True})
        method = get_method(config.method)
        model = make_model(config, KNOWN_SHAPES[config.dataset])
        split = parameter_split(model, method, shared_keys=config.shared_keys,
                                personal_keys=config.personal_keys,
                                local_buffers=config.dp)
        state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        rng = np.random.default_rng(0)

        def arrays(keys):
            return {k: rng.standard_normal(state[k].shape).astype(state[k].dtype)
                    if np.issubdtype(state[k].dtype, np.floating) else state[k].copy()
                    for k in keys}

        strategy = build_strategy(config, method, split, args.clients)
        corrected = hasattr(strategy, "global_reference")
        if corrected:
            strategy.global_reference = arrays(split.corrected)
        recorder = RunRecorder(config, traffic=None, echo=lambda _: None)
        recorder.start()
        records = RoundRecords(config, strategy, recorder, fingerprint(config, args.clients),
                               None)
        stores = [DurableState(Path(folder) / "bench" / SIMULATION_FOLDER, "bench", p, "t")
                  for p in range(args.clients)]
        keeps_state = bool(split.personal or method.personal_model or corrected)
        times: dict[str, list[float]] = {"server, after aggregation": [],
                                         "server, after evaluation": [],
                                         "clients, stage": [], "clients, commit": []}
        for server_round in range(1, args.rounds + 1):
            started = time.perf_counter()
            records.on_trained(server_round, to_record(arrays(split.shared)),
                               MetricRecord({"clients": args.clients}),
                               RoundReport(server_round, args.clients))
            trained = time.perf_counter()
            records.checkpoint(server_round, COMPLETE, new_arrays=False)
            times["server, after aggregation"].append(trained - started)
            times["server, after evaluation"].append(time.perf_counter() - trained)
            if not keeps_state:
                continue
            staged = [ClientState(
                personal=arrays(split.personal) if split.personal else None,
                local_reference=arrays(split.corrected) if corrected else None,
                personal_model=arrays(list(state)) if method.personal_model else None,
                rounds_trained=server_round, round=server_round)
                for _ in range(args.clients)]
            started = time.perf_counter()
            for store, client_state in zip(stores, staged):
                store.write(client_state, PENDING)
            written = time.perf_counter()
            for store in stores:
                store.commit()
            times["clients, stage"].append(written - started)
            times["clients, commit"].append(time.perf_counter() - written)
    print(f"{config.label} on {config.dataset}/{config.model}, {args.clients} clients, "
          f"{args.rounds} rounds (median ms per round):")
    total = 0.0
    for part, values in times.items():
        median = 1e3 * statistics.median(values) if values else 0.0
        total += median
        print(f"  {part:28s} {median:8.1f}")
    print(f"  {'total':28s} {total:8.1f}  = {100 * total / (1e3 * args.round_seconds):.2f}% "
          f"of a {args.round_seconds:g} s round")


if __name__ == "__main__":
    main()
