"""Run the app once in Flower's Ray simulation, on a private SuperLink that is always stopped::

    python -m fedspc_app.simulate --run-config conf/cpu-cifar100-cnn.toml \\
        --clients 10 --client-cpus 1 --set "num-rounds=3"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedspc_app.core.errors import FedSPCError
from fedspc_app.launch.processes import exit_on_termination
from fedspc_app.launch.runconfig import parse_assignments, read_toml
from fedspc_app.launch.superlink import SimulationFailed, run_simulation, simulation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", help="TOML file of run-config overrides (conf/*.toml)")
    parser.add_argument("--set", default="", help='extra overrides, e.g. "num-rounds=3 fedspc=true"')
    parser.add_argument("--clients", type=int, default=10, help="simulated SuperNodes (K)")
    parser.add_argument("--client-cpus", type=float, default=1.0)
    parser.add_argument("--client-gpus", type=float, default=0.0,
                        help="GPU fraction per client, e.g. 0.25 runs 4 clients per GPU")
    parser.add_argument("--flwr-home", help="keep the SuperLink's FLWR_HOME here")
    parser.add_argument("--log", help="also write the run's output to this file")
    args = parser.parse_args(argv)
    run_config = read_toml(args.run_config) if args.run_config else {}
    run_config.update(parse_assignments(args.set))
    try:
        with exit_on_termination(), \
                simulation(Path(args.flwr_home) if args.flwr_home else None) as superlink:
            run_simulation(run_config, superlink=superlink, clients=args.clients,
                           client_cpus=args.client_cpus, client_gpus=args.client_gpus,
                           log_file=Path(args.log) if args.log else None, echo=True)
    except (FedSPCError, SimulationFailed) as error:
        print(f"fedspc: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
