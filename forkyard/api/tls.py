"""Sandbox URLs over HTTPS: the node's own certificate authority and the ``*.{domain}`` certificate.

``sandbox.get_host(port)`` is ``{port}-{sandbox_id}.{domain}`` where ``domain`` is what the API
returned (E2B users put ``https://`` in front). To make that work on a single node the server
creates a certificate authority once (``{data_dir}/tls/ca.pem``, its key ``ca-key.pem`` 0600,
valid ten years) and, at every start, a server certificate for ``*.{sandbox_domain}`` and
``{sandbox_domain}`` signed by it, which the HTTPS listener (``FORKYARD_TLS_PORT``) serves. Clients
trust the CA through ``SSL_CERT_FILE`` (Python; ``ca-bundle.pem`` is the system's CAs plus ours,
because that variable replaces the system store) or ``NODE_EXTRA_CA_CERTS`` (Node; ``ca.pem``,
which adds to it).

The sandbox domain needs two labels at least (``forkyard.localhost``, not ``localhost``): TLS
clients (OpenSSL's host check, browsers) refuse a wildcard directly under a single label.
Keys are ECDSA P-256: generating one takes about a millisecond, so the start-up cost of the
listener is negligible and it is on by default.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from forkyard.config import Settings
from forkyard.errors import Invalid

#: Where Debian keeps the system's CA bundle (ca-certificates), included in ``ca-bundle.pem``.
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CA_YEARS = 10
SERVER_DAYS = 365


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    #: The system CAs plus ours: what ``SSL_CERT_FILE`` should name.
    bundle: Path
    cert: Path
    key: Path


def check_domain(domain: str) -> str:
    labels = domain.split(".")
    if len(labels) < 2 or not all(labels) or any(not _label_ok(label) for label in labels):
        raise Invalid(
            f"sandbox domain {domain!r} must be a DNS name of two labels at least (e.g. "
            "forkyard.localhost): TLS clients refuse a wildcard certificate under a single label"
        )
    return domain.lower()


def _label_ok(label: str) -> bool:
    return len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii()


def _name(common: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "forkyard"),
            x509.NameAttribute(NameOID.COMMON_NAME, common),
        ]
    )


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_or_make_ca(tls_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The node's CA: made on the first start, then kept (clients trust it once)."""
    cert_path, key_path = tls_dir / "ca.pem", tls_dir / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    name = _name(f"forkyard sandbox CA ({os.uname().nodename})")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365 * CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(key_path, _pem_key(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def ensure_tls(settings: Settings) -> TlsFiles:
    """The CA (kept), a fresh server certificate for the sandbox domain, and the bundle."""
    domain = check_domain(settings.sandbox_domain)
    tls_dir = settings.data_dir / "tls"
    tls_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    ca, ca_key = _load_or_make_ca(tls_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    names: list[x509.GeneralName] = [x509.DNSName(f"*.{domain}"), x509.DNSName(domain)]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"*.{domain}"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    files = TlsFiles(
        ca=tls_dir / "ca.pem",
        bundle=tls_dir / "ca-bundle.pem",
        cert=tls_dir / "server.pem",
        key=tls_dir / "server-key.pem",
    )
    _write_private(files.key, _pem_key(key))
    _write_public(files.cert, cert.public_bytes(serialization.Encoding.PEM) + ca_pem)
    system = SYSTEM_BUNDLE.read_bytes() if SYSTEM_BUNDLE.exists() else b""
    _write_public(files.bundle, system.rstrip(b"\n") + b"\n" + ca_pem if system else ca_pem)
    return files


def https_domain(settings: Settings) -> str:
    """The ``domain`` the API returns while the HTTPS listener runs (its port unless 443)."""
    domain = check_domain(settings.sandbox_domain)
    return domain if settings.tls_port == 443 else f"{domain}:{settings.tls_port}"
