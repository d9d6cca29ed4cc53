"""The ``flwr`` CLI's connection to a SuperLink, in ``$FLWR_HOME/config.toml``.

``flwr run``, ``flwr supernode register`` and ``flwr supernode list`` reach the
SuperLink through a named connection::

    [superlink]
    default = "fedspc"

    [superlink.fedspc]
    address = "link.example.org:8000"
    root-certificates = "/home/me/fedspc/certs/ca.crt"

This module adds or replaces one such entry and keeps every other one::

    python -m deploy.connection fedspc link.example.org:8000 --root-certificates certs/ca.crt
    python -m deploy.connection trial 127.0.0.1:8000 --insecure
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import tomli_w

from fedspc_app.core.files import atomic_write


def flwr_home(env: dict[str, str] | None = None) -> Path:
    """``$FLWR_HOME``, or Flower's default ``~/.flwr``."""
    env = os.environ if env is None else env
    return Path(env.get("FLWR_HOME") or Path.home() / ".flwr").expanduser()


def write_connection(home: str | os.PathLike[str], name: str, address: str, *,
                     root_certificates: str | os.PathLike[str] | None = None,
                     insecure: bool = False, default: bool = True) -> Path:
    """Add or replace the connection ``name`` (as in ``flwr run . <name>``) in
    ``<home>/config.toml``; return that file.

    ``address`` is the SuperLink's ``host:port`` (with TLS, a host in its
    certificate); give either the deployment's CA certificate (stored as an
    absolute path) or ``insecure=True``. ``default`` also makes it the connection
    ``flwr`` uses when given none.
    """
    if insecure == (root_certificates is not None):
        raise ValueError("give exactly one of root_certificates and insecure=True")
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"a connection name is letters, digits, '-' and '_', got {name!r}")
    path = Path(home).expanduser() / "config.toml"
    config = tomllib.loads(path.read_text()) if path.exists() else {}
    links = config.setdefault("superlink", {})
    entry: dict[str, object] = {"address": address}
    if insecure:
        entry["insecure"] = True
    else:
        ca = Path(root_certificates).expanduser().resolve()
        if not ca.is_file():
            raise FileNotFoundError(f"no CA certificate at {ca}")
        entry["root-certificates"] = str(ca)
    links[name] = entry
    if default or "default" not in links:
        links["default"] = name
    atomic_write(path, tomli_w.dumps(config))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.connection",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="connection name, e.g. fedspc")
    parser.add_argument("address", help="the SuperLink's host:port")
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument("--root-certificates", help="the deployment's ca.crt")
    security.add_argument("--insecure", action="store_true", help="plain HTTP")
    parser.add_argument("--not-default", action="store_true",
                        help="do not make it the default connection")
    args = parser.parse_args(argv)
    path = write_connection(flwr_home(), args.name, args.address,
                            root_certificates=args.root_certificates,
                            insecure=args.insecure, default=not args.not_default)
    print(f"Connection {args.name!r} -> {args.address} written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
