"""Certificates and keys for the local control plane, generated in-process.

A throwaway CA, the API server's serving certificate (SANs: loopback, the test
bridge's gateway, the in-cluster names), its client certificate for kubelets
(``kube-apiserver-kubelet-client``: logs, exec, port-forward on a real node) and the
service-account signing key. The CA key is kept so that :func:`issue_cert` can sign
more (a real node's kubelet: client ``system:node:<name>`` and serving certificates).
Files are mode 0600 in a directory the harness owns.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path       # private: signs service-account tokens
    sa_pub: Path       # public: verifies them
    ca_key: Path       # signs the certificates issue_cert makes
    kubelet_client_cert: Path  # the API server's identity towards kubelets (KUBELET_CLIENT_USER)
    kubelet_client_key: Path


# The user the API server's kubelet-client certificate names (kubelet authorizes it by webhook).
KUBELET_CLIENT_USER = "kube-apiserver-kubelet-client"
_VALID = dt.timedelta(days=2)


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         encipher_only=False, decipher_only=False)


def _sign(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, cn: str, orgs: tuple[str, ...],
          ips: tuple[str, ...], dns: tuple[str, ...], server: bool, client: bool,
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    usages = ([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (
        x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + _VALID)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    sans += [x509.DNSName(d) for d in dns]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def issue_cert(pki: Pki, cert_path: Path, key_path: Path, *, cn: str, orgs: tuple[str, ...] = (),
               ips: tuple[str, ...] = (), dns: tuple[str, ...] = (), server: bool = False,
               client: bool = False) -> None:
    """Sign a certificate for ``cn`` (organizations = Kubernetes groups) with the environment's CA
    and write it and its key (mode 0600). ``server``/``client``: the extended key usages."""
    if not (server or client):
        raise ValueError("issue_cert: a certificate must be for server or client authentication (or both)")
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca_key}: not the EC key make_pki writes")
    cert, key = _sign(ca_cert, ca_key, cn=cn, orgs=orgs, ips=ips, dns=dns, server=server, client=client)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    _write(key_path, _pem_key(key))


def make_pki(directory: Path, *, ips: list[str], dns: list[str]) -> Pki:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = dt.datetime.now(dt.UTC)
    not_before, not_after = now - dt.timedelta(hours=1), now + _VALID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dynsnap-testenv-ca")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    cert, key = _sign(ca, ca_key, cn="kube-apiserver", orgs=(), ips=tuple(ips), dns=tuple(dns), server=True,
                      client=False)
    kcert, kkey = _sign(ca, ca_key, cn=KUBELET_CLIENT_USER, orgs=(), ips=(), dns=(), server=False, client=True)

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pki = Pki(directory / "ca.crt", directory / "apiserver.crt", directory / "apiserver.key",
              directory / "sa.key", directory / "sa.pub", directory / "ca.key",
              directory / "apiserver-kubelet-client.crt", directory / "apiserver-kubelet-client.key")
    _write(pki.ca_cert, ca.public_bytes(serialization.Encoding.PEM))
    _write(pki.ca_key, _pem_key(ca_key))
    _write(pki.serving_cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(pki.serving_key, _pem_key(key))
    _write(pki.kubelet_client_cert, kcert.public_bytes(serialization.Encoding.PEM))
    _write(pki.kubelet_client_key, _pem_key(kkey))
    _write(pki.sa_key, _pem_key(sa_key))
    _write(pki.sa_pub, sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    return pki
