"""Run the app once in Flower's Ray simulation, on a private SuperLink that is always stopped::

    python -m fedspc_app.simulate --run-config conf/cpu-cifar100-cnn.toml \\
        --clients 10 --client-cpus 1 --set "num-rounds=3" [--resume]

Exit code 2: bad input (nothing was started); 1: the run failed; 3: it stopped on a
pause request (`python -m fedspc_app.experiments pause RUN_DIR`), and the same
command with --resume continues it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedspc_app.core.errors import FedSPCError
from fedspc_app.launch.cli import (
    BAD_INPUT,
    add_resource_arguments,
    add_run_config_arguments,
    fail,
    simulate_once,
    simulation_overrides,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_config_arguments(parser)
    add_resource_arguments(parser)
    parser.add_argument("--flwr-home", help="keep the SuperLink's FLWR_HOME here")
    parser.add_argument("--log", help="also write the run's output to this file")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in the run's folder (resume = true)")
    args = parser.parse_args(argv)
    try:
        run_config = simulation_overrides(args, **({"resume": True} if args.resume else {}))
    except FedSPCError as error:
        return fail(error, BAD_INPUT)
    return simulate_once(run_config, args, echo=True,
                         flwr_home=Path(args.flwr_home) if args.flwr_home else None,
                         log_file=Path(args.log) if args.log else None)


if __name__ == "__main__":
    raise SystemExit(main())
