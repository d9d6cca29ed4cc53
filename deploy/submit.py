"""Submit a run to a deployed SuperLink and stream its log (what ``deploy/run.sh`` runs).

``flwr run`` takes either a TOML file or ``key=value`` pairs; this accepts a preset
*and* overrides, checks the merged config here first (a typo fails before
anything is sent), requires ``num-clients`` (the number of SuperNodes), and then
runs ``flwr run <app> <connection> --stream``::

    python -m deploy.submit --connection fedspc --clients 2 \\
        --run-config conf/cpu-cifar100-cnn.toml \\
        --set "method='fedrep' fedspc=true output-dir='/srv/fedspc/results'"

Unlike :mod:`fedspc_app.simulate`, paths are left as given: ``output-dir`` is a
folder on the SuperLink machine (relative ones are relative to the SuperLink's
working directory) and ``data-dir`` a folder on every SuperNode (a node-config
``data-dir`` overrides it on that node).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import FedSPCError
from fedspc_app.launch.cli import BAD_INPUT, add_run_config_arguments, fail
from fedspc_app.launch.processes import child_env, console_script
from fedspc_app.launch.runconfig import (
    APP_DIR,
    app_defaults,
    load_overrides,
    run_config_file,
)


def build_run_config(run_config_file: str | None, assignments: str,
                     clients: int | None) -> dict[str, Any]:
    """The overrides to send: the preset, then ``assignments``, then ``num-clients``;
    a :class:`FedSPCError` if they are invalid or ``num-clients`` is missing."""
    overrides = load_overrides(run_config_file, assignments)
    if clients is not None:
        overrides["num-clients"] = clients
    config = parse_run_config({**app_defaults(), **overrides})
    if not config.num_clients:
        raise FedSPCError("give --clients N (or num-clients in the run-config): the number "
                          "of SuperNodes, each started with num-partitions=N")
    return overrides


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.submit",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--connection", default="",
                        help="flwr CLI connection name (default: the config's default)")
    parser.add_argument("--clients", type=int, help="number of SuperNodes (num-clients)")
    add_run_config_arguments(parser)
    parser.add_argument("--app", default=str(APP_DIR), help="the app folder (default: this "
                        "project)")
    args = parser.parse_args(argv)
    try:
        overrides = build_run_config(args.run_config, args.set, args.clients)
    except FedSPCError as error:
        return fail(error, BAD_INPUT)
    output_dir = str(overrides.get("output-dir", app_defaults()["output-dir"]))
    if not Path(output_dir).is_absolute():
        print(f"note: output-dir {output_dir!r} is relative to the SuperLink's working "
              "directory on the server machine", file=sys.stderr)
    connection = [args.connection] if args.connection else []
    with run_config_file(overrides) as config_path:
        command = [console_script("flwr"), "run", args.app, *connection, "--stream",
                   "--run-config", config_path]
        return subprocess.call(command, env=child_env())


if __name__ == "__main__":
    sys.exit(main())
