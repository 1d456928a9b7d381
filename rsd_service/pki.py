"""Throwaway certificates for a local run: a CA, a server certificate and a client certificate.

    paths = make_local_pki(Path("secure"))   # {"ca", "server", "server_key", "client", "client_key"}: PEM files

For `rsd cluster --secure` and the tests, never for a deployment: the keys are written unencrypted
(mode 0600) and the certificates live one day. The server certificate names 127.0.0.1 and
localhost (the addresses the launcher's services are dialled at) and may also serve as a client
certificate (a drafter is both); the client certificate is for clients only. EC P-256, SHA-256.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("127.0.0.1", "localhost")
VALID_FOR = datetime.timedelta(days=1)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate a little clock skew
        .not_valid_after(now + VALID_FOR)
    )


def make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA that may sign leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(cn, _name(cn), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    cn: str,
    usages: Sequence[x509.ObjectIdentifier],
    hosts: Sequence[str] = (),
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A certificate `ca_cert` signs, for `usages` (ExtendedKeyUsageOID.SERVER_AUTH / CLIENT_AUTH), naming
    `hosts` (IP addresses or DNS names) as subject alternative names."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(cn, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def write_pem(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> tuple[str, str]:
    """path.pem (the certificate) and, with a key, path.key (PKCS8, unencrypted, mode 0600). -> their paths."""
    cert_path, key_path = path.with_suffix(".pem"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is None:
        return str(cert_path), ""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return str(cert_path), str(key_path)


def make_local_pki(folder: Path, hosts: Sequence[str] = LOCAL_HOSTS) -> dict[str, str]:
    """ca.pem, server.pem + .key (server and client use, naming `hosts`), client.pem + .key in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca = make_ca("rsd local CA")
    paths = {"ca": write_pem(folder / "ca", ca)[0]}
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    server_key, server = make_leaf(ca_key, ca, "rsd server", both, hosts)
    paths["server"], paths["server_key"] = write_pem(folder / "server", server, server_key)
    client_key, client = make_leaf(ca_key, ca, "rsd client", [ExtendedKeyUsageOID.CLIENT_AUTH])
    paths["client"], paths["client_key"] = write_pem(folder / "client", client, client_key)
    return paths
