#!/usr/bin/env bash
# Start one Flower SuperNode of a FedSPC deployment (run on each client machine).
#
#   deploy/start-supernode.sh --superlink HOST:8000 --ca ca.crt --key keys/node-0 \
#       --partition-id 0 --num-partitions 2 \
#       [--state-dir /var/lib/fedspc] [--data-dir /data] [--port 9094]
#   deploy/start-supernode.sh --insecure --superlink 127.0.0.1:8000 ...   # loopback trials
#
# --superlink A       the SuperLink's address as host:port; the host must be one of the
#                     names in its certificate (python -m deploy.pki certs --host ...).
# --ca FILE           the deployment's CA certificate (ca.crt) to verify the SuperLink.
# --key FILE          this node's private key (python -m deploy.pki node-keys); its
#                     .pub must be registered on the SuperLink (register-supernode.sh).
#                     Omit it when the SuperLink runs with --no-auth.
# --partition-id I    which of the num-partitions data partitions this node trains on.
# --num-partitions N  must equal the run-config's num-clients.
# --state-dir DIR     keep this client's personalized parameters and FedSPC reference
#                     u_k in DIR (one file per run and partition, written after every
#                     successful round), so that a restarted node continues where it
#                     stopped. Default: ${XDG_STATE_HOME:-~/.local/state}/fedspc.
# --no-state-dir      keep them only in this SuperNode's memory (lost if it restarts).
# --data-dir DIR      dataset folder on this machine; overrides the run-config's data-dir.
# --port P            local port of the SuperNode's Runtime API, used by its ClientApp
#                     processes (default 9094; give each SuperNode on one machine its own).
# --insecure          connect without TLS (only to a SuperLink started with --insecure).
# Anything after `--` goes to flower-supernode unchanged (e.g. --max-retries 10).
#
# The process replaces this shell (exec), so its PID is the SuperNode's. Stop it with
# SIGTERM (Ctrl-C): it then tells the SuperLink it left, and can rejoin at once.
set -euo pipefail

superlink="" ca="" key="" pid="" num="" data_dir="" port="9094" insecure=0 extra=()
state_dir="${XDG_STATE_HOME:-$HOME/.local/state}/fedspc"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --superlink) superlink="$2"; shift 2 ;;
        --ca) ca="$2"; shift 2 ;;
        --key) key="$2"; shift 2 ;;
        --partition-id) pid="$2"; shift 2 ;;
        --num-partitions) num="$2"; shift 2 ;;
        --state-dir) state_dir="$2"; shift 2 ;;
        --no-state-dir) state_dir=""; shift ;;
        --data-dir) data_dir="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --insecure) insecure=1; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "start-supernode.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

fail() { echo "start-supernode.sh: $*" >&2; exit 2; }
[[ -n "$superlink" ]] || fail "--superlink HOST:PORT is required"
# Decimal, without leading zeros: bash reads 010 as octal (8) and 08 as an error, and
# node-config (TOML) refuses a leading zero.
decimal() { [[ "$2" =~ ^(0|[1-9][0-9]{0,8})$ ]] ||
    fail "$1 must be a decimal integer from 0 to 999999999 without leading zeros, got '$2'"; }
decimal --partition-id "$pid"
decimal --num-partitions "$num"
decimal --port "$port"
[[ "$num" -gt 0 ]] || fail "--num-partitions must be a positive integer"
[[ "$pid" -lt "$num" ]] || fail "--partition-id must be smaller than --num-partitions"
[[ "$port" -ge 1 && "$port" -le 65535 ]] || fail "--port must be in 1..65535, got $port"

# Node-config values are TOML: paths go in single quotes (literal strings), made absolute
# because ClientApp processes resolve relative paths against their own working directory.
node_config="partition-id=$pid num-partitions=$num"
if [[ -n "$state_dir" ]]; then
    [[ -d "$state_dir" ]] || mkdir -p -m 700 "$state_dir"  # it will hold personalized models
    state_dir="$(cd "$state_dir" && pwd)"
    [[ "$state_dir" != *"'"* ]] || fail "--state-dir must not contain a single quote"
    node_config+=" state-dir='$state_dir'"
fi
if [[ -n "$data_dir" ]]; then
    [[ -d "$data_dir" ]] || fail "--data-dir $data_dir is not a folder"
    data_dir="$(cd "$data_dir" && pwd)"
    [[ "$data_dir" != *"'"* ]] || fail "--data-dir must not contain a single quote"
    node_config+=" data-dir='$data_dir'"
fi

args=(--superlink "$superlink" --port "$port" --node-config "$node_config")
if [[ $insecure -eq 1 ]]; then
    [[ -z "$key" ]] || fail "--key needs TLS: node authentication is refused over --insecure"
    args+=(--insecure)
else
    [[ -n "$ca" ]] || fail "--ca FILE is required (or --insecure)"
    [[ -f "$ca" ]] || fail "$ca does not exist"
    args+=(--root-certificates "$ca")
    if [[ -n "$key" ]]; then
        [[ -f "$key" ]] || fail "$key does not exist"
        args+=(--auth-supernode-private-key "$key")
    fi
fi

# Flower's processes call each other over this machine's loopback, which gRPC would
# send through $http_proxy / $https_proxy too: keep it out of any proxy.
export no_proxy="${no_proxy:+$no_proxy,}127.0.0.1,localhost,::1"
export NO_PROXY="${NO_PROXY:+$NO_PROXY,}127.0.0.1,localhost,::1"
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
exec flower-supernode "${args[@]}" "${extra[@]}"
