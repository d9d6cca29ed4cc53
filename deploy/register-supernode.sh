#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink started with node authentication
# (run where the flwr CLI is configured: python -m deploy.connection ...).
#
#   deploy/register-supernode.sh [--connection fedspc] keys/node-0.pub [keys/node-1.pub ...]
#
# Only registered keys can join; `flwr supernode list` shows them, and
# `flwr supernode unregister <node-id>` removes one.
set -euo pipefail
connection=()
if [[ "${1:-}" == "--connection" ]]; then
    connection=("$2")
    shift 2
fi
if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    if [[ $# -eq 0 ]]; then exit 2; fi
    exit 0
fi
for public_key in "$@"; do
    flwr supernode register "$public_key" "${connection[@]}"
done
