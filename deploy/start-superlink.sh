#!/usr/bin/env bash
# Start the Flower SuperLink of a FedSPC deployment (run on the server machine).
#
#   deploy/start-superlink.sh --certs certs [--host 0.0.0.0] [--port 8000]
#                             [--database state/superlink.db] [--no-auth]
#   deploy/start-superlink.sh --insecure ...        # plain HTTP, loopback trials only
#
# --certs DIR   folder written by `python -m deploy.pki certs` (ca.crt, server.pem,
#               server.key); the SuperLink serves TLS with them.
# --host H      address to listen on (default 0.0.0.0: every interface). The Fleet,
#               Control and Runtime APIs all share this one port.
# --port P      default 8000.
# --database F  keep the SuperLink's state (registered SuperNodes, runs) in an SQLite
#               file so that it survives a restart; default: in memory.
# --no-auth     accept any SuperNode (default: only registered public keys).
# --insecure    no TLS (implies --no-auth); never across a real network.
# Anything after `--` goes to flower-superlink unchanged.
#
# Runtime installation of the app's dependencies is off: install the project
# (`pip install -e .`) in the environment that runs this script. The process
# replaces this shell (exec), so its PID is the SuperLink's.
set -euo pipefail

certs="" host="0.0.0.0" port="8000" database="" auth=1 insecure=0 extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --certs) certs="$2"; shift 2 ;;
        --host) host="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --database) database="$2"; shift 2 ;;
        --no-auth) auth=0; shift ;;
        --insecure) insecure=1; auth=0; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "start-superlink.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# Decimal, without leading zeros (bash would read 010 as octal).
if [[ ! "$port" =~ ^[1-9][0-9]{0,4}$ || "$port" -gt 65535 ]]; then
    echo "start-superlink.sh: --port must be a decimal integer in 1..65535 without" \
         "leading zeros, got '$port'" >&2
    exit 2
fi
args=(--host "$host" --port "$port" --disable-runtime-dependency-installation)
if [[ $insecure -eq 1 ]]; then
    args+=(--insecure)
else
    if [[ -z "$certs" ]]; then
        echo "start-superlink.sh: --certs DIR is required (or --insecure)" >&2
        exit 2
    fi
    for file in ca.crt server.pem server.key; do
        if [[ ! -f "$certs/$file" ]]; then
            echo "start-superlink.sh: $certs/$file is missing; create it with" \
                 "python -m deploy.pki certs --out $certs --host <this machine's name or IP>" >&2
            exit 2
        fi
    done
    args+=(--ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/server.pem"
           --ssl-keyfile "$certs/server.key")
    if [[ $auth -eq 1 ]]; then
        args+=(--enable-supernode-auth)
    fi
fi
if [[ -n "$database" ]]; then
    mkdir -p "$(dirname "$database")"
    args+=(--database "$database")
fi

export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
# Flower's processes call each other over this machine's loopback, which gRPC would
# send through $http_proxy / $https_proxy too: keep it out of any proxy.
export no_proxy="${no_proxy:+$no_proxy,}127.0.0.1,localhost,::1"
export NO_PROXY="${NO_PROXY:+$NO_PROXY,}127.0.0.1,localhost,::1"
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
exec flower-superlink "${args[@]}" "${extra[@]}"
