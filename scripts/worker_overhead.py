"""Does a client train slower inside a Ray worker than in a plain process?

``scripts/benchmark.py --compare --plain-workers N`` found the simulation's clients
computing slower than the same clients in N plain one-thread processes. This script
takes Flower out of that comparison: the same client (the project's data, model and
:func:`clients.train_client`, via :mod:`fedspc_app.serial`) trains the same round
again and again, at the same time in ``--workers`` places of one CPU each:

* ``process``: spawned processes of one torch thread (the plain loop's workers);
* ``ray``: Ray actors of one CPU each, Ray started as Flower's simulation starts it
  (no dashboard, a runtime environment that sets ``PYTHONPATH``);

and prints the seconds per call and images per second of each, and their ratio::

    python scripts/worker_overhead.py --run-config conf/cpu-cifar100-cnn.toml \\
        --set "data-dir='/path/to/data'" --calls 8

The first call of every worker (imports, the first optimizer call) is left out of
the means. Run it on an otherwise idle machine; it measures a few percent.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedspc_app.core.errors import FedSPCError
from fedspc_app.launch import cli
from fedspc_app.launch.runconfig import resolve_run_config

MODES = ("process", "ray")


class Trainer:
    """One client's round, repeated: the same message, state and batches each call."""

    def __init__(self, config, num_clients: int, client: int) -> None:
        import torch

        torch.set_num_threads(1)
        from clients import ClientState
        from fedspc_app.models.run_model import state_arrays
        from fedspc_app.serial import _Clients

        self.clients = _Clients(config, num_clients)
        self.client = client
        self.state = ClientState()
        self.shared = state_arrays(self.clients.model, self.clients.split.shared)

    def call(self) -> tuple[float, int]:
        """Seconds and training images of one round of the client."""
        started = time.perf_counter()
        outcome = self.clients.train(self.client, self.shared, self.state, None, 1)
        return time.perf_counter() - started, int(outcome.metrics["examples-seen"])


_TRAINER: Trainer | None = None


def _start(config, num_clients: int, client: int) -> None:
    global _TRAINER
    _TRAINER = Trainer(config, num_clients, client)


def _call() -> tuple[float, int]:
    return _TRAINER.call()


def run_processes(config, args) -> list[list[tuple[float, int]]]:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as probe:
        probe.submit(int).result()  # the interpreter and the pool work
    pools = [ProcessPoolExecutor(1, mp_context=context, initializer=_start,
                                 initargs=(config, args.clients, args.client))
             for _ in range(args.workers)]
    try:
        results: list[list[tuple[float, int]]] = [[] for _ in pools]
        for _ in range(args.calls):
            futures = [pool.submit(_call) for pool in pools]
            for index, future in enumerate(futures):
                results[index].append(future.result())
        return results
    finally:
        for pool in pools:
            pool.shutdown()


def run_ray(config, args) -> list[list[tuple[float, int]]]:
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # as Flower's runs
    import ray

    pythonpath = os.pathsep.join(sys.path)
    ray.init(num_cpus=args.workers, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        actor = ray.remote(num_cpus=1)(Trainer)
        actors = [actor.remote(config, args.clients, args.client) for _ in range(args.workers)]
        results: list[list[tuple[float, int]]] = [[] for _ in actors]
        for _ in range(args.calls):
            for index, value in enumerate(ray.get([a.call.remote() for a in actors])):
                results[index].append(value)
        return results
    finally:
        ray.shutdown()


def summary(results: list[list[tuple[float, int]]]) -> tuple[float, float]:
    """Mean seconds per call and images per second per worker, first calls left out."""
    steady = [call for worker in results for call in worker[1:]]
    seconds = statistics.fmean(s for s, _ in steady)
    return seconds, statistics.fmean(n / s for s, n in steady)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_run_config_arguments(parser)
    parser.add_argument("--clients", type=int, default=10, help="partitions (K)")
    parser.add_argument("--client", type=int, default=0, help="the partition that trains")
    parser.add_argument("--workers", type=int, default=2, help="places training at once")
    parser.add_argument("--calls", type=int, default=8, help="rounds per worker")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from {', '.join(MODES)}")
    args = parser.parse_args(argv)
    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or any(m not in MODES for m in modes):
            raise FedSPCError(f"--modes: choose from {', '.join(MODES)}, got {args.modes!r}")
        if args.workers < 1 or args.calls < 2:
            raise FedSPCError("--workers must be >= 1 and --calls >= 2")
        if not 0 <= args.client < args.clients:
            raise FedSPCError(f"--client must be in [0, {args.clients})")
        _, config = resolve_run_config(cli.load_overrides(args.run_config, args.set))
    except FedSPCError as error:
        return cli.fail(error, cli.BAD_INPUT)
    rows = {}
    for mode in modes:
        started = time.perf_counter()
        results = (run_processes if mode == "process" else run_ray)(config, args)
        rows[mode] = summary(results)
        firsts = ", ".join(f"{worker[0][0]:.2f}" for worker in results)
        print(f"{mode:8} {rows[mode][0]:7.3f} s/call  {rows[mode][1]:8.1f} images/s per "
              f"worker  (first calls {firsts} s; {time.perf_counter() - started:.0f} s "
              f"in all)", flush=True)
    if len(rows) == 2:
        ratio = rows["ray"][0] / rows["process"][0]
        print(f"a Ray worker takes x{ratio:.3f} the time of a plain process per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
