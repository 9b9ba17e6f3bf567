"""The server's own TLS certificate: made on first start for a listener that has none configured.

A pool listening beyond loopback speaks TLS whether or not its admin set up a certificate
(`tls = "auto"`): without `tls_cert`/`tls_key`, the server makes an ECDSA P-256 key and a
self-signed certificate under its data directory once, keeps them (the key 0600), and logs the
certificate's SHA-256 fingerprint at every start. poolctl pins that fingerprint on first use
(ctl/known_servers.py), like ssh's known_hosts, so no one between them can read or alter a request.
`cryptography` makes them: the standard library's ssl can use a certificate but not make one.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from daemon.tls import fingerprint

VALID_DAYS = 3650


def ensure_certificate(directory: Path, host: str) -> tuple[Path, Path]:
    """The certificate and key under `directory`, made for `host` (and this machine's name) if
    there are none yet. Blocking (a key is made once)."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(socket.gethostname()), x509.DNSName("localhost")]
    try:
        address = ipaddress.ip_address(host)
        if not address.is_unspecified:
            names.append(x509.IPAddress(address))
    except ValueError:
        names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpupool server {socket.gethostname()}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem_key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def certificate_fingerprint(cert_path: Path) -> str:
    """The SHA-256 fingerprint of the PEM certificate at `cert_path`, as poolctl shows it."""
    return fingerprint(ssl.PEM_cert_to_DER_cert(cert_path.read_text()))
