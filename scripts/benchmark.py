"""Throughput benchmark: per-round wall time and training images/second of a config.

Runs the app in Flower's Ray simulation (a private SuperLink, see
``fedspc_app.simulate``) for a few rounds and prints one row per round from the
run's metrics.json, then the mean over the rounds after the first (which also pays
for starting Ray and loading data)::

    python scripts/benchmark.py --run-config conf/cpu-cifar100-cnn.toml \\
        --set "data-dir='/path/to/data'" --rounds 3 --clients 10 --client-cpus 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedspc_app.core.errors import FedSPCError  # noqa: E402
from fedspc_app.launch import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_run_config_arguments(parser)
    cli.add_resource_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log", help="write the run's output here")
    args = parser.parse_args(argv)
    try:
        run_config = cli.simulation_overrides(args, **{"num-rounds": args.rounds})
    except FedSPCError as error:
        return cli.fail(error, cli.BAD_INPUT)

    out = Path(tempfile.mkdtemp(prefix="fedspc-bench-"))
    run_config.update({"output-dir": str(out), "run-name": "benchmark"})
    started = time.perf_counter()
    code = cli.simulate_once(run_config, args, log_file=Path(args.log) if args.log else None)
    if code:
        return code
    total = time.perf_counter() - started
    rounds = json.loads((out / "benchmark" / "metrics.json").read_text())["rounds"]

    print(f"{'round':>5} {'seconds':>9} {'train images':>13} {'images/s':>10} "
          f"{'sent MB':>9} {'recv MB':>9} {'accuracy':>9}")
    for row in rounds:
        print(f"{row['round']:>5} {row['round-seconds']:>9.2f} {row['train-images']:>13} "
              f"{row['images-per-second']:>10.1f} {row['bytes-sent'] / 1e6:>9.2f} "
              f"{row['bytes-received'] / 1e6:>9.2f} {100 * (row.get('accuracy') or 0):>8.2f}%")
    steady = rounds[1:] or rounds
    seconds = sum(r["round-seconds"] for r in steady) / len(steady)
    images = sum(r["train-images"] for r in steady) / len(steady)
    print(f"steady state (rounds {steady[0]['round']}-{steady[-1]['round']}): "
          f"{seconds:.2f} s/round, {images / seconds:.1f} training images/s "
          f"(round time includes evaluation); whole command {total:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
