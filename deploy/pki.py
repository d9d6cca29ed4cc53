"""TLS certificates for the SuperLink and authentication keys for SuperNodes.

Everything is generated locally with the ``cryptography`` package (no network,
no openssl needed)::

    python -m deploy.pki certs --out certs --host 192.168.1.10 --host link.example.org
    python -m deploy.pki node-keys --out keys node-0 node-1

``certs`` writes a private CA (``ca.crt``, ``ca.key``) and the SuperLink's
certificate and key signed by it (``server.pem``, ``server.key``). The server
certificate's subject alternative names always hold ``localhost``, ``127.0.0.1``
and ``::1`` (the SuperLink's own ServerApp process connects to it on loopback)
plus every ``--host`` given: the names or addresses SuperNodes and the ``flwr``
CLI use to reach the SuperLink. ``ca.crt`` is the only file that leaves the
SuperLink machine: SuperNodes get it as ``--root-certificates`` and the CLI as
``root-certificates``.

``node-keys`` writes one EC key pair per SuperNode in the OpenSSH formats Flower
reads: ``<name>`` (private, for ``flower-supernode --auth-supernode-private-key``,
stays on that node) and ``<name>.pub`` (public, for ``flwr supernode register``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
CURVE = ec.SECP384R1  # P-384: what Flower's docs use for node keys; fine for TLS too


@dataclass(frozen=True)
class CertificatePaths:
    """The files written by :func:`create_certificates`."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKeyPaths:
    """The files written by :func:`create_node_key`."""

    private_key: Path
    public_key: Path


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Write ``data``; private keys are created readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def subject_alt_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """SAN entries for the loopback names plus ``hosts`` (IPs or DNS names), deduplicated.

    Raises
    ------
    ValueError
        For a host that is neither (``HOST:PORT``, a URL): its certificate would never
        match the name a client connects to, and TLS would fail later and obscurely.
    """
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in (*LOOPBACK_NAMES, *hosts):
        host = host.strip().strip("[]")
        if not host or host.lower() in seen:
            continue
        seen.add(host.lower())
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not is_dns_name(host):
                raise ValueError(
                    f"--host {host!r} is neither an IP address nor a DNS name: give the "
                    "host alone, without a port or scheme (e.g. 192.168.1.10 or "
                    "link.example.org, not 192.168.1.10:9092 or https://link.example.org)"
                ) from None
            names.append(x509.DNSName(host))
    return names


def is_dns_name(host: str) -> bool:
    """Letters, digits and hyphens in dot-separated labels of 1-63 characters, none
    starting or ending with a hyphen; 253 characters at most; a leading ``*.`` (a
    wildcard) allowed."""
    labels = host.removeprefix("*.").split(".")
    return len(host) <= 253 and all(DNS_LABEL.fullmatch(label) for label in labels)


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "FedSPC deployment"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def create_certificates(out_dir: str | os.PathLike[str], hosts: Sequence[str] = (), *,
                        days: int = 365, common_name: str = "fedspc-superlink"
                        ) -> CertificatePaths:
    """Create a CA and a SuperLink certificate signed by it in ``out_dir``.

    Parameters
    ----------
    out_dir : path-like
        Created if missing; existing files of the same names are replaced.
    hosts : sequence of str
        Host names or IP addresses (v4 or v6) under which SuperNodes and the CLI
        reach the SuperLink, in addition to the loopback names.
    days : int
        Validity of both certificates.
    common_name : str
        The server certificate's CN (clients check the SANs, not the CN).

    Returns
    -------
    CertificatePaths
    """
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    out = Path(out_dir)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # clock skew
    until = now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(CURVE())
    ca_name = _name("FedSPC deployment CA")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True,
            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(CURVE())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(subject_alt_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=True, key_cert_sign=False,
            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    def private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    paths = CertificatePaths(out / "ca.crt", out / "ca.key", out / "server.pem",
                             out / "server.key")
    _write(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(paths.ca_key, private_pem(ca_key), private=True)
    _write(paths.server_cert, server_cert.public_bytes(serialization.Encoding.PEM),
           private=False)
    _write(paths.server_key, private_pem(server_key), private=True)
    return paths


def create_node_key(out_dir: str | os.PathLike[str], name: str) -> NodeKeyPaths:
    """Create one SuperNode's EC key pair (OpenSSH formats, like ``ssh-keygen -t ecdsa -b 384``).

    Parameters
    ----------
    out_dir : path-like
        Created if missing.
    name : str
        File name of the private key; the public key is ``<name>.pub``.
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a key name must be a plain file name, got {name!r}")
    key = ec.generate_private_key(CURVE())
    private = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    paths = NodeKeyPaths(Path(out_dir) / name, Path(out_dir) / f"{name}.pub")
    _write(paths.private_key, private, private=True)
    _write(paths.public_key, public + f" {name}\n".encode(), private=False)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.pki",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    certs = commands.add_parser("certs", help="a CA and the SuperLink's TLS certificate")
    certs.add_argument("--out", required=True, help="folder for ca.crt, ca.key, server.pem, "
                       "server.key")
    certs.add_argument("--host", action="append", default=[],
                       help="a name or IP under which the SuperLink is reached, without "
                       "port or scheme (repeatable)")
    certs.add_argument("--days", type=int, default=365)
    keys = commands.add_parser("node-keys", help="SuperNode authentication key pairs")
    keys.add_argument("--out", required=True, help="folder for <name> and <name>.pub")
    keys.add_argument("names", nargs="+", help="one name per SuperNode, e.g. node-0 node-1")
    args = parser.parse_args(argv)
    if args.command == "certs":
        try:
            subject_alt_names(args.host)
        except ValueError as error:
            certs.error(str(error))
        paths = create_certificates(args.out, args.host, days=args.days)
        names = ", ".join(str(getattr(n, "value", n)) for n in subject_alt_names(args.host))
        print(f"CA certificate:     {paths.ca_cert}  (copy to every SuperNode and CLI machine)")
        print(f"CA key:             {paths.ca_key}  (keep offline; only needed for new "
              "certificates)")
        print(f"SuperLink cert/key: {paths.server_cert}, {paths.server_key}")
        print(f"Valid for: {names}")
    else:
        for name in args.names:
            paths = create_node_key(args.out, name)
            print(f"{name}: private {paths.private_key} (stays on the node), "
                  f"public {paths.public_key} (register with flwr supernode register)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
