"""Throughput benchmark: per-round wall time and training images/second of a config.

Runs the app in Flower's Ray simulation (a private SuperLink, see
``fedspc_app.simulate``) for a few rounds and prints one row per round from the
run's metrics.json, then the mean over the rounds after the first (which also pays
for starting Ray and loading data)::

    python scripts/benchmark.py --run-config conf/cpu-cifar100-cnn.toml \\
        --set "data-dir='/path/to/data'" --rounds 3 --clients 10 --client-cpus 1

``--compare`` first runs the same rounds as one plain sequential PyTorch loop in
this process (``fedspc_app.serial``: no Flower, no Ray, ``--threads`` torch
threads), then the simulation, and prints both, their ratio, whether their metrics
agree, and where the simulation's time goes: its clients' setup (parsing the
message, building the model, loading data and client state) and work (training,
evaluation, saving state), and what is left (the engine: Ray, message encoding and
transfer, scheduling).

With ``--compare`` and ``method = fedavg`` a minimal loop runs first: every client
trained and evaluated with the project's data, model and training loop
(:func:`fedspc_app.training.loop.train_epochs`) and nothing else, in one process. It is
the work itself, the baseline both other runs are held against; its metrics equal the
plain loop's when the two do the same arithmetic. Both loops and the simulation run in
the run-config's precision and memory layout.

``--plain-workers N`` adds a third run: the plain loop with its clients in N
spawned processes of one thread each (what the simulation does with one CPU per
client, without Flower or Ray). Its row separates the cost of running clients in
parallel processes on the machine from the cost of the engine.

``--cpu-account`` samples every process of the simulation (and of the plain loop in
``--plain-workers`` processes) from ``/proc`` while it runs
(:mod:`fedspc_app.launch.cpu_account`): CPU seconds by role (Ray's GCS, raylet,
dashboard, agents and log monitor, its ClientApp workers, the SuperLink, the
simulation process holding the ServerApp, the SuperExec, ``flwr run``), per round
and in the training phases; for the client workers their cores in use against the
wall time, their main thread's wait for a CPU, their threads and the thread
settings they started with. It uses CPU time, not wall time, so it holds on a
loaded machine. ``--parallel-only`` skips the minimal and one-process loops and keeps
the ``--plain-workers`` baseline, the one the account compares with::

    python scripts/benchmark.py --run-config conf/cpu-cifar100-cnn.toml \\
        --set "data-dir='/path/to/data'" --rounds 4 --clients 10 --client-cpus 1 \\
        --compare --plain-workers 2 --parallel-only --cpu-account --json account.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedspc_app.core.errors import FedSPCError
from fedspc_app.launch import cli
from fedspc_app.launch.cpu_account import CpuAccount, MetricsWatch, format_account, summarize
from fedspc_app.launch.runconfig import resolve_run_config

COMPARED = ("accuracy", "loss", "train-loss", "train-images")


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def print_rounds(rounds: list[dict]) -> None:
    print(f"{'round':>5} {'seconds':>9} {'train images':>13} {'images/s':>10} "
          f"{'sent MB':>9} {'recv MB':>9} {'accuracy':>9}")
    for row in rounds:
        print(f"{row['round']:>5} {row['round-seconds']:>9.2f} {row['train-images']:>13} "
              f"{row['images-per-second']:>10.1f} {row['bytes-sent'] / 1e6:>9.2f} "
              f"{row['bytes-received'] / 1e6:>9.2f} {100 * (row.get('accuracy') or 0):>8.2f}%")


def run_plain(run_config: dict, clients: int, threads: int, workers: int = 1,
              account: float | None = None) -> dict:
    """The plain loop: in this process on ``threads`` torch threads, or its clients
    in ``workers`` processes of one thread each. With ``account`` (a sampling
    interval) its processes' CPU account goes in as ``cpu-account``."""
    import torch

    from fedspc_app.serial import run_serial

    torch.set_num_threads(threads)
    _, config = resolve_run_config(run_config)
    ends: dict[int, float] = {}

    def echo(line: str) -> None:  # a round's row is done when it is printed
        ends[len(ends) + 1] = time.time()
        print(line)

    sampler = CpuAccount(interval=account).start() if account else None
    started = time.perf_counter()
    try:
        result = run_serial(config, clients, echo=echo, workers=workers)
    finally:
        if sampler is not None:
            sampler.stop()
    result["total-seconds"] = time.perf_counter() - started
    if sampler is not None:
        result["cpu-account"] = summarize(sampler, result["rounds"], ends)
    return result


def run_minimal(run_config: dict, clients: int, threads: int) -> dict:
    """FedAvg's work and nothing else: each round every client resets the model to
    the global one, trains it, the server averages (float64, partition order), then
    every client evaluates the average."""
    import numpy as np
    import torch

    from fedspc_app.data.run_data import load_partition, load_run_dataset
    from fedspc_app.models.run_model import make_model
    from fedspc_app.training.client_data import client_data, seeded_generator
    from fedspc_app.training.loop import evaluate_model, train_epochs

    torch.set_num_threads(threads)
    _, config = resolve_run_config(run_config)
    started = time.perf_counter()
    dataset = load_run_dataset(config)
    load_partition(config, clients)
    data = [client_data(config, k, clients) for k in range(clients)]
    model = make_model(config, dataset).to(data[0].device)
    trainable = [name for name, _ in model.named_parameters()]
    options = config.compute_options
    average = {key: value.clone() for key, value in model.state_dict().items()}
    setup = time.perf_counter() - started
    rows = []
    for server_round in range(1, config.num_rounds + 1):
        round_started = time.perf_counter()
        total = {key: torch.zeros(v.shape, dtype=torch.float64) for key, v in average.items()}
        losses, images = [], 0
        for k in range(clients):
            model.load_state_dict(average)
            result = train_epochs(
                model, data[k].batches("train", seeded_generator(config.seed, server_round, k,
                                                                 "train")),
                epochs=config.local_epochs, trainable=trainable,
                learning_rate=config.learning_rate, momentum=config.momentum,
                weight_decay=config.weight_decay, **options)
            losses.append(result.mean_loss)
            images += result.examples
            for key, value in model.state_dict().items():
                total[key] += value.detach().cpu().double() * (1.0 / clients)
        average = {key: (value.round() if average[key].dtype == torch.int64 else value)
                   .to(average[key].dtype) for key, value in total.items()}
        trained = time.perf_counter()
        model.load_state_dict(average)
        results = [evaluate_model(model, data[k].batches("test")(), **options)
                   for k in range(clients)]
        rows.append({
            "round": server_round, "train-loss": float(np.mean(losses)),
            "train-images": images, "train-seconds": trained - round_started,
            "accuracy": float(np.mean([c / n for c, n, _ in results])),
            "loss": sum(s for _, _, s in results) / sum(n for _, n, _ in results),
            "evaluate-seconds": time.perf_counter() - trained,
            "round-seconds": time.perf_counter() - round_started,
        })
        print(f"[minimal loop] round {server_round}/{config.num_rounds}: "
              f"{rows[-1]['round-seconds']:.2f} s, accuracy {100 * rows[-1]['accuracy']:.2f}%")
    return {"setup-seconds": setup, "rounds": rows,
            "total-seconds": time.perf_counter() - started}


def parallel_workers(args: argparse.Namespace) -> int:
    """How many clients the simulation runs at once on this machine's CPUs."""
    if args.client_gpus > 0:
        return max(1, int(1 / args.client_gpus))
    return max(1, min(args.clients, int((os.cpu_count() or 1) // args.client_cpus)))


def print_parallel(plain: dict | None, parallel: dict, flower: list[dict],
                   args: argparse.Namespace) -> None:
    """The plain loop in one process (unless ``--parallel-only``), in
    ``--plain-workers`` processes, and the simulation."""
    workers = args.plain_workers
    runs = (plain["rounds"] if plain else [], parallel["rounds"], flower)
    steady = [mean(r["round-seconds"] for r in rows[1:] or rows) for rows in runs]
    same = all(all(p.get(k) == q.get(k) for k in COMPARED)
               for p, q in zip(parallel["rounds"], flower))
    print(f"\nplain loop in {workers} processes of one thread: {steady[1]:.2f} s/round "
          f"steady, round 1 {parallel['rounds'][0]['round-seconds'] - steady[1]:+.2f} s; "
          f"metrics {'identical to' if same else 'differ from'} the simulation's")
    print((f"  running clients in {workers} processes instead of one process of "
           f"{args.threads} threads: x{steady[1] / steady[0]:.3f}; " if plain else "  ")
          + f"the simulation over the processes: x{steady[2] / steady[1]:.3f}")
    phase = mean(r["train-seconds"] for r in runs[1][1:] or runs[1])
    work = mean(r.get("train-client-work-seconds", 0.0) for r in flower[1:] or flower)
    work /= parallel_workers(args)
    print(f"  training phase, steady: the plain loop in {workers} processes {phase:.2f} s; "
          f"the simulation's clients worked {work:.2f} s per worker (x{work / phase:.3f})")


def print_against_minimal(minimal: dict, plain: dict, flower: list[dict]) -> None:
    """Per round: the minimal loop, the plain loop and the simulation, each over the
    minimal loop."""
    runs = (minimal["rounds"], plain["rounds"], flower)
    print(f"\n{'round':>5} {'minimal s':>10} {'plain s':>9} {'flower s':>9} "
          f"{'plain/min':>10} {'flower/min':>11}   metrics (minimal against plain)")
    for m, p, f in zip(*runs):
        same = all(m.get(k) == p.get(k) for k in ("accuracy", "train-loss", "train-images"))
        print(f"{m['round']:>5} {m['round-seconds']:>10.2f} {p['round-seconds']:>9.2f} "
              f"{f['round-seconds']:>9.2f} {p['round-seconds'] / m['round-seconds']:>10.3f} "
              f"{f['round-seconds'] / m['round-seconds']:>11.3f}   "
              f"{'identical' if same else 'differ'}")
    steady = [mean(r["round-seconds"] for r in rows[1:] or rows) for rows in runs]
    firsts = [rows[0]["round-seconds"] - s for rows, s in zip(runs, steady)]
    print(f"steady: minimal {steady[0]:.2f} s/round, plain x{steady[1] / steady[0]:.3f}, "
          f"flower x{steady[2] / steady[0]:.3f}; round 1 over steady: minimal "
          f"{firsts[0]:+.2f} s, plain {firsts[1]:+.2f} s, flower {firsts[2]:+.2f} s")
    for phase in ("train", "evaluate"):
        values = [mean(r.get(f"{phase}-seconds", 0.0) for r in rows[1:] or rows)
                  for rows in runs]
        print(f"  {phase} phase, steady: minimal {values[0]:.2f} s, plain {values[1]:.2f} s, "
              f"flower {values[2]:.2f} s")


def print_comparison(plain: dict, flower: list[dict], flower_total: float,
                     args: argparse.Namespace) -> None:
    rows = plain["rounds"]
    print(f"\n{'round':>5} {'plain s':>9} {'flower s':>9} {'ratio':>7}   metrics")
    for p, f in zip(rows, flower):
        same = all(p.get(k) == f.get(k) for k in COMPARED)
        print(f"{p['round']:>5} {p['round-seconds']:>9.2f} {f['round-seconds']:>9.2f} "
              f"{f['round-seconds'] / p['round-seconds']:>7.3f}   "
              f"{'identical' if same else 'differ'}")
    steady_p, steady_f = rows[1:] or rows, flower[1:] or flower
    plain_s = mean(r["round-seconds"] for r in steady_p)
    flower_s = mean(r["round-seconds"] for r in steady_f)
    print(f"steady state (rounds {steady_f[0]['round']}-{steady_f[-1]['round']}): plain "
          f"{plain_s:.2f} s/round, flower {flower_s:.2f} s/round, ratio "
          f"{flower_s / plain_s:.3f}")
    print(f"round 1 over the steady state: plain {rows[0]['round-seconds'] - plain_s:+.2f} s "
          f"(+ {plain['setup-seconds']:.2f} s loading before it), flower "
          f"{flower[0]['round-seconds'] - flower_s:+.2f} s")
    rounded = sum(r["round-seconds"] for r in flower)
    print(f"outside the rounds: plain {plain['total-seconds'] - sum(r['round-seconds'] for r in rows):.2f} s, "
          f"flower {flower_total - rounded:.2f} s (SuperLink, flwr run, Ray and the "
          "ServerApp starting and stopping)")

    workers = parallel_workers(args)
    print(f"\nwhere the simulation's time goes ({workers} clients at a time; seconds per "
          "round, mean over the steady rounds, round 1 in brackets):")
    print(f"{'':24} {'plain':>9} {'flower':>9}   {'client setup':>13} {'client work':>12} "
          f"{'engine':>8}")
    for phase in ("train", "evaluate"):
        def parts(row, phase=phase):
            wall = row.get(f"{phase}-seconds", 0.0) or 0.0
            setup = (row.get(f"{phase}-client-setup-seconds", 0.0) or 0.0) / workers
            work = (row.get(f"{phase}-client-work-seconds", 0.0) or 0.0) / workers
            return wall, setup, work, wall - setup - work
        steady = [parts(r) for r in steady_f]
        first = parts(flower[0])
        wall, setup, work, engine = (mean(v[i] for v in steady) for i in range(4))
        plain_phase = mean(r.get(f"{phase}-seconds", 0.0) for r in steady_p)
        print(f"{phase + ' phase':24} {plain_phase:>9.2f} {wall:>9.2f}   "
              f"{setup:>6.2f} ({first[1]:.2f}) {work:>5.2f} ({first[2]:.2f}) "
              f"{engine:>5.2f} ({first[3]:.2f})")
    print("client setup and work are the clients' own timings divided by the clients "
          "running at once; engine is the phase's wall time left after them")
    first = flower[0]
    if "train-worker-ready-seconds" in first:
        start = first.get("train-worker-start-seconds")
        print("round 1: the last new worker process "
              + (f"started {start:.2f} s after the training messages were sent "
                 "(Ray starting its workers), and " if start is not None else "")
              + f"began its first message {first['train-worker-ready-seconds']:.2f} s "
              "after them (loading the ClientApp and its imports"
              + (f"; importing the ClientApp module took up to "
                 f"{first['train-worker-import-seconds']:.2f} s and was done "
                 f"{first['train-worker-imported-seconds']:.2f} s after the send"
                 if "train-worker-imported-seconds" in first else "") + ")")


def print_accounts(accounts: dict[str, dict], args: argparse.Namespace) -> None:
    """The CPU accounts of the simulation and of the plain loop in processes, and
    their client workers' training CPU side by side."""
    titles = {"flower": "the Flower simulation",
              "plain-parallel": f"the plain loop in {args.plain_workers} processes"}
    for name, account in accounts.items():
        print(format_account(titles[name], account))
    print("\nclient workers in the steady rounds' training phases:")
    for name, account in accounts.items():
        workers = [w for w in account["workers"] if w["train-cpu-seconds"] > 0]
        cpu = sum(w["train-cpu-seconds"] for w in workers)
        others = sum(r["train-cpu-seconds-per-round"] for r in account["roles"]
                     if r["role"] not in {w["role"] for w in workers})
        wall, rounds = account["train-wall-seconds"], max(1, account["steady-rounds"])
        print(f"  {titles[name]}: {len(workers)} workers, {cpu / rounds:.2f} CPU s per round "
              f"in {wall / rounds:.2f} s of training = {cpu / wall if wall else 0:.3f} cores; "
              f"the run's other processes {others:.2f} CPU s per round in the same phases")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_run_config_arguments(parser)
    cli.add_resource_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log", help="write the run's output here")
    parser.add_argument("--compare", action="store_true",
                        help="also run the same rounds as a plain PyTorch loop and compare")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the plain loop (default: every CPU)")
    parser.add_argument("--plain-workers", type=int, default=1,
                        help="with --compare, also run the plain loop with its clients in "
                             "this many one-thread processes (default 1: not run)")
    parser.add_argument("--parallel-only", action="store_true",
                        help="with --compare and --plain-workers, run only the plain loop "
                             "in processes as the baseline (not the minimal loop nor the "
                             "one-process plain loop)")
    parser.add_argument("--cpu-account", action="store_true",
                        help="sample the simulation's processes (and the plain loop's in "
                             "--plain-workers processes) from /proc and print their CPU "
                             "seconds by role")
    parser.add_argument("--account-interval", type=float, default=0.5,
                        help="seconds between the --cpu-account samples (default 0.5)")
    parser.add_argument("--json", help="write the runs' rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        if args.plain_workers < 1:
            raise FedSPCError(f"plain-workers must be >= 1, got {args.plain_workers}")
        if args.plain_workers > 1 and not args.compare:
            raise FedSPCError("--plain-workers is a baseline of --compare: add --compare")
        if args.parallel_only and args.plain_workers < 2:
            raise FedSPCError("--parallel-only keeps the --plain-workers baseline only: "
                              "add --compare --plain-workers N (N >= 2)")
        if not args.account_interval > 0:
            raise FedSPCError(f"account-interval must be > 0, got {args.account_interval}")
        run_config = cli.simulation_overrides(args, **{"num-rounds": args.rounds})
    except FedSPCError as error:
        return cli.fail(error, cli.BAD_INPUT)

    out = Path(tempfile.mkdtemp(prefix="fedspc-bench-"))
    run_config.update({"output-dir": str(out), "run-name": "benchmark"})
    plain = parallel = minimal = None
    if args.compare and not args.parallel_only:
        if run_config.get("method", "fedavg") == "fedavg":
            minimal = run_minimal({**run_config, "run-name": "minimal"}, args.clients,
                                  args.threads)
        plain = run_plain({**run_config, "run-name": "plain"}, args.clients, args.threads)
    if args.compare and args.plain_workers > 1:
        parallel = run_plain({**run_config, "run-name": "plain-parallel"}, args.clients,
                             args.threads, workers=args.plain_workers,
                             account=args.account_interval if args.cpu_account else None)
    watch = MetricsWatch(out / "benchmark" / "metrics.json")
    sampler = (CpuAccount(interval=args.account_interval, hooks=[watch]).start()
               if args.cpu_account else None)
    started = time.perf_counter()
    try:
        code = cli.simulate_once(run_config, args,
                                 log_file=Path(args.log) if args.log else None)
    finally:
        if sampler is not None:
            sampler.stop()
    if code:
        return code
    total = time.perf_counter() - started
    rounds = json.loads((out / "benchmark" / "metrics.json").read_text())["rounds"]
    accounts = {}
    if sampler is not None:
        accounts["flower"] = summarize(sampler, rounds, watch.ends)
        if parallel is not None:
            accounts["plain-parallel"] = parallel.pop("cpu-account")

    print_rounds(rounds)
    steady = rounds[1:] or rounds
    seconds = sum(r["round-seconds"] for r in steady) / len(steady)
    images = sum(r["train-images"] for r in steady) / len(steady)
    print(f"steady state (rounds {steady[0]['round']}-{steady[-1]['round']}): "
          f"{seconds:.2f} s/round, {images / seconds:.1f} training images/s "
          f"(round time includes evaluation); whole command {total:.1f} s")
    if plain is not None:
        print_comparison(plain, rounds, total, args)
    if minimal is not None:
        print_against_minimal(minimal, plain, rounds)
    if parallel is not None:
        print_parallel(plain, parallel, rounds, args)
    if accounts:
        print_accounts(accounts, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"flower": rounds, "plain": plain,
                                               "minimal": minimal,
                                               "plain-parallel": parallel,
                                               "flower-total-seconds": total,
                                               "cpu-account": accounts or None}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
