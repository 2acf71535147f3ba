"""Throwaway TLS material for one test: a CA, a server certificate for 127.0.0.1 and a client certificate.

Made fresh in the test's tmp dir with the cryptography library (Debian's python3-cryptography or PyPI's);
nothing is committed.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(directory: Path, client_cn: str = "system:node:node-1") -> Pki:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("ate-devplugd test CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    # Key identifiers as kubeadm's certificates carry them: Python 3.13's default TLS context verifies
    # strictly (VERIFY_X509_STRICT), which refuses a certificate without an Authority Key Identifier.
    authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())

    def leaf(name: x509.Name, usage: x509.ObjectIdentifier, san: bool) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(authority, critical=False)
        )
        if san:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    server_cert, server_key = leaf(_name("127.0.0.1"), ExtendedKeyUsageOID.SERVER_AUTH, True)
    client_cert, client_key = leaf(_name(client_cn, "system:nodes"), ExtendedKeyUsageOID.CLIENT_AUTH, False)
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        directory / "ca.crt",
        directory / "server.crt",
        directory / "server.key",
        directory / "client.crt",
        directory / "client.key",
    )
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server_cert)
    pki.server_key.write_bytes(server_key)
    pki.client_cert.write_bytes(client_cert)
    pki.client_key.write_bytes(client_key)
    return pki
