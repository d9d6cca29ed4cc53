"""What the command-line launchers share: the run-config arguments, the checks made
before anything starts, and errors reported as one ``fedspc: ...`` line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedspc_app.core.errors import FedSPCError
from fedspc_app.launch.processes import LaunchFailed, exit_on_termination
from fedspc_app.launch.runconfig import (
    check_clients,
    check_resources,
    load_overrides,
    resolve_run_config,
)
from fedspc_app.launch.superlink import SimulationFailed, run_simulation, simulation
from fedspc_app.runs.pause import STOP_BY, RunPaused

BAD_INPUT = 2  # as argparse exits on a bad argument
FAILED = 1
PAUSED = 3  # stopped on a pause request; the same command with resume continues it
RUN_ERRORS = (FedSPCError, SimulationFailed, LaunchFailed, TimeoutError, OSError)
"""What a started run can fail with, short of a bug."""


class JoinedAssignments(argparse.Action):
    """``--set``: repeatable, its values joined with spaces in the order given (a key
    set twice takes the later value)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        earlier = getattr(namespace, self.dest, None) or ""
        setattr(namespace, self.dest, f"{earlier} {values}".strip())


def add_run_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-config", help="TOML preset of run-config overrides (conf/*.toml)")
    parser.add_argument("--set", default="", action=JoinedAssignments,
                        help='overrides applied after the preset, e.g. "num-rounds=3 '
                             'fedspc=true" (repeatable)')


def add_resource_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int,
                        help="simulated SuperNodes (K); default: the run-config's "
                             "num-clients, else 10")
    parser.add_argument("--client-cpus", type=float, default=1.0)
    parser.add_argument("--client-gpus", type=float, default=0.0,
                        help="GPU fraction per client, e.g. 0.25 runs 4 clients per GPU")


def simulation_overrides(args: argparse.Namespace, **fixed: Any) -> dict[str, Any]:
    """``--run-config``, then ``--set``, then ``fixed``, checked; else a FedSPCError.
    Sets ``args.clients`` when it was not given (the run-config's num-clients, else 10)."""
    overrides = {**load_overrides(args.run_config, args.set), **fixed}
    num_clients = resolve_run_config(overrides)[1].num_clients
    if args.clients is None:
        args.clients = num_clients or 10
    check_resources(args.clients, args.client_cpus, args.client_gpus)
    check_clients(num_clients, args.clients)
    return overrides


def fail(error: BaseException, code: int) -> int:
    print(f"fedspc: {error}", file=sys.stderr)
    return code


def simulate_once(run_config: dict[str, Any], args: argparse.Namespace, *,
                  flwr_home: Path | None = None, log_file: Path | None = None,
                  echo: bool = False) -> int:
    """Run ``run_config`` on a private SuperLink with the resources in ``args``; 0,
    :data:`PAUSED` (a pause request stopped it) or :data:`FAILED` after reporting why."""
    try:
        with exit_on_termination(), simulation(flwr_home) as superlink:
            run_simulation(run_config, superlink=superlink, clients=args.clients,
                           client_cpus=args.client_cpus, client_gpus=args.client_gpus,
                           log_file=log_file, echo=echo)
    except RunPaused as paused:
        again = "the same command with --resume"
        if paused.run_name != resolve_run_config(run_config)[1].resolved_run_name:
            again += f" and run-name='{paused.run_name}' (the folder it went to)"
        if paused.reason.startswith(STOP_BY):  # that time has come: each start would pause
            again += " and a later stop-by (or none)"
        print(f"fedspc: {paused}; {again} continues it", file=sys.stderr)
        return PAUSED
    except RUN_ERRORS as error:
        return fail(error, FAILED)
    return 0
