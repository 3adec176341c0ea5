"""``ps.tls``: TLS for every shardline connection (the parameter server's and the stage links), with a
per-job self-signed certificate whose SHA-256 fingerprint travels with the job secret; connectors pin
that fingerprint (no CA, no host names: the job's own listeners are the only ones to trust).

What it adds to the HMAC handshake, which still runs inside TLS: confidentiality and integrity of every
frame after it (parameters, gradients, activations, metrics), so another tenant on the network can
neither read the model nor flip bits in a gradient. The certificate and its key are generated on the
driver (``new_job_cert``, with the ``cryptography`` package) per job attempt, like the secret, and
shipped with it in the task closure to whichever process listens (the driver's PS, rank 0's PS with
``ps.placement: task``, each stage's link listener). Without ``ps.tls`` nothing here is imported.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from pipeline.errors import AuthenticationError
from pipeline.wire.deadline import remaining

_VALID_DAYS = 30


@dataclass(frozen=True)
class PinnedCert:
    """What a connector needs: the SHA-256 fingerprint (hex) of the certificate its listeners present."""

    fingerprint: str


@dataclass(frozen=True)
class ServerCert:
    """A listener's certificate and private key (PEM). As secret as the job secret: ``repr`` hides the key."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(ssl.PEM_cert_to_DER_cert(self.cert_pem.decode("ascii")))

    def pinned(self) -> PinnedCert:
        return PinnedCert(self.fingerprint)


def fingerprint_of(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def new_job_cert(common_name: str = "shardline job") -> ServerCert:
    """A fresh self-signed EC P-256 certificate and key for one job attempt."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))  # executors' clocks may lag the driver's
            .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
            .sign(key, hashes.SHA256()))
    return ServerCert(cert.public_bytes(serialization.Encoding.PEM),
                      key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))


def job_cert(enabled: bool) -> Optional[ServerCert]:
    """``ps.tls``: a new certificate for this job attempt, or None (plain TCP)."""
    return new_job_cert() if enabled else None


@functools.lru_cache(maxsize=8)
def _server_context(cert: ServerCert) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # load_cert_chain reads files only: a private directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="shardline-tls-") as folder:
        path = os.path.join(folder, "job.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(cert.key_pem + cert.cert_pem)
        context.load_cert_chain(path)
    return context


@functools.lru_cache(maxsize=1)
def _client_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # No CA and no host name: the peer is trusted by the pinned fingerprint alone (checked after the
    # handshake, before a byte of the protocol is sent).
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def wrap_server(sock: socket.socket, cert: ServerCert, *, timeout: float) -> ssl.SSLSocket:
    """The listener side of TLS on an accepted socket, handshake done within ``timeout`` seconds.
    Raises OSError (ssl.SSLError, TimeoutError) for a peer that does not speak TLS in time."""
    tls = _server_context(cert).wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    tls.settimeout(timeout)
    tls.do_handshake()
    return tls


def wrap_client(sock: socket.socket, pinned: PinnedCert, *, deadline: Optional[float],
                peer: str) -> ssl.SSLSocket:
    """The connector side: TLS, then the peer's certificate must be the job's (``pinned``). Raises
    AuthenticationError naming both fingerprints, or OSError as the handshake breaks."""
    tls = _client_context().wrap_socket(sock, do_handshake_on_connect=False)
    try:
        tls.settimeout(remaining(deadline))
        tls.do_handshake()
        der = tls.getpeercert(binary_form=True) or b""
    except BaseException:
        tls.close()
        raise
    got = fingerprint_of(der)
    if not hmac.compare_digest(got, pinned.fingerprint):
        tls.close()
        raise AuthenticationError(f"{peer} presented a TLS certificate with SHA-256 fingerprint {got[:16]}..., "
                                  f"not this job's {pinned.fingerprint[:16]}... (ps.tls); refusing the connection")
    return tls
