"""Scale benchmark: memory and time per round as the number of clients K grows.

For each method and each K, runs ``python -m fedspc_app.simulate`` with
``fraction-train`` and ``evaluate-fraction`` set so that about ``--per-round`` clients
train and evaluate per round (the last round evaluates all K, as always), and samples
the memory of every process the run starts (the simulate command, its SuperLink,
Flower's SuperExec and simulation process, Ray and its workers) twice a second.
Prints one row per run: the peak of the summed proportional set size (PSS: shared
pages split between the processes that share them, so the sum is what the run
really holds) and of the summed resident set size (RSS, which counts shared pages
once per process), the mean time of the rounds between the first and the last, and
the last round (which evaluates every client)::

    python scripts/bench_scale.py --run-config conf/cpu-cifar100-cnn.toml \\
        --set "data-dir='/data'" --clients 10 100 1000 --methods fedrep ditto
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fedspc_app.launch.processes import owned_processes, stop_tree

GIB = 1024 ** 3


def memory_of(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in bytes of one process; zeros when it is gone or unreadable."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("Pss:", "Rss:"):
            values[parts[0]] = int(parts[1]) * 1024
    return values.get("Pss:", 0), values.get("Rss:", 0)


class PeakMemory(threading.Thread):
    """Samples the summed memory of a process tree until stopped; keeps the peaks."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_pss = self.peak_rss = 0
        self.peak_processes = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            tree = owned_processes(self.pid)
            pss = rss = 0
            for member in tree:
                p, r = memory_of(member)
                pss, rss = pss + p, rss + r
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self.peak_processes = max(self.peak_processes, len(tree))
            self.stopping.wait(self.interval)


def run_one(method: str, clients: int, args: argparse.Namespace, out: Path) -> dict:
    fraction = min(1.0, args.per_round / clients)
    name = f"{method}-k{clients}"
    settings = (f"{args.set} method='{method}' fedspc=true num-rounds={args.rounds} "
                f"fraction-train={fraction} evaluate-fraction={fraction} "
                f"output-dir='{out}' run-name='{name}'")
    command = [sys.executable, "-m", "fedspc_app.simulate", "--clients", str(clients),
               "--client-cpus", str(args.client_cpus), "--set", settings]
    if args.run_config:
        command[3:3] = ["--run-config", args.run_config]
    log = (out / f"{name}.log").open("w")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    sampler = PeakMemory(process.pid)
    sampler.start()
    try:
        code = process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        stop_tree(process, None, timeout=0)
        code = -1
    finally:
        sampler.stopping.set()
        sampler.join()
        log.close()
    wall = time.perf_counter() - started
    row = {"method": method, "clients": clients, "fraction": fraction, "exit": code,
           "wall-seconds": wall, "peak-pss-gib": sampler.peak_pss / GIB,
           "peak-rss-gib": sampler.peak_rss / GIB, "processes": sampler.peak_processes}
    try:
        rounds = json.loads((out / name / "metrics.json").read_text())["rounds"]
    except (OSError, ValueError, KeyError):
        return row
    middle = rounds[1:-1] or rounds
    row.update({
        "rounds": len(rounds),
        "round-1-seconds": rounds[0]["round-seconds"],
        "steady-seconds": sum(r["round-seconds"] for r in middle) / len(middle),
        "train-clients": sum(r.get("train-clients", 0) for r in middle) / len(middle),
        "last-round-seconds": rounds[-1]["round-seconds"],
        "last-round-clients": rounds[-1].get("clients", 0),
        "final-accuracy": rounds[-1].get("accuracy"),
    })
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", help="TOML preset (conf/*.toml)")
    parser.add_argument("--set", default="", help="run-config overrides")
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--methods", nargs="+", default=["fedrep", "ditto"])
    parser.add_argument("--per-round", type=int, default=10,
                        help="clients sampled per round for training and evaluation")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--client-cpus", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--output", help="folder for the runs (default: a temporary one)")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    out = Path(args.output or tempfile.mkdtemp(prefix="fedspc-scale-")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    print(f"{'method':>8} {'K':>6} {'train/rnd':>9} {'PSS GiB':>8} {'RSS GiB':>8} "
          f"{'procs':>6} {'round 1 s':>9} {'steady s':>9} {'last s':>8} {'exit':>5}",
          flush=True)
    rows = []
    for method in args.methods:
        for clients in args.clients:
            row = run_one(method, clients, args, out)
            rows.append(row)
            print(f"{method:>8} {clients:>6} {row.get('train-clients', 0):>9.1f} "
                  f"{row['peak-pss-gib']:>8.2f} {row['peak-rss-gib']:>8.2f} "
                  f"{row['processes']:>6} {row.get('round-1-seconds', float('nan')):>9.2f} "
                  f"{row.get('steady-seconds', float('nan')):>9.2f} "
                  f"{row.get('last-round-seconds', float('nan')):>8.2f} {row['exit']:>5}",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"runs and logs in {out}")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
