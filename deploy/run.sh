#!/usr/bin/env bash
# Submit a FedSPC run to the deployed SuperLink and stream its log (run where the flwr
# CLI is configured: python -m deploy.connection ...).
#
#   deploy/run.sh --clients 2 [--connection fedspc] [--run-config conf/X.toml] \
#                 [--set "method='fedrep' fedspc=true output-dir='/srv/fedspc/results'"]
#
# --clients N must equal the number of SuperNodes (each started with num-partitions=N).
# The config is checked here before anything is sent; see python -m deploy.submit --help.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
exec python -m deploy.submit "$@"
