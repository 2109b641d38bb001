"""TLS credentials from PEM files, for servers (``build_server``) and channels (the scheduler's to its
workers, the client's to the scheduler, the health probe). Nothing here imports torch or pydantic."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

PathLike = str | os.PathLike


def _read(path: PathLike | None, what: str) -> bytes | None:
    if path is None or str(path) == "":
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc.strerror}") from None


def server_credentials(cert_file: PathLike | None, key_file: PathLike | None,
                       client_ca_file: PathLike | None = None) -> grpc.ServerCredentials | None:
    """TLS for a server port, or None (plaintext) when no certificate is given. With ``client_ca_file``
    every client must present a certificate signed by it (mutual TLS)."""
    cert, key = _read(cert_file, "TLS certificate"), _read(key_file, "TLS private key")
    if cert is None and key is None:
        if client_ca_file:
            raise ValueError("a client CA (mutual TLS) needs a server certificate and key")
        return None
    if cert is None or key is None:
        raise ValueError("a TLS server needs both a certificate and its private key")
    client_ca = _read(client_ca_file, "TLS client CA")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None)


def settings_server_credentials(settings) -> grpc.ServerCredentials | None:
    """``server_credentials`` from a ProcessSettings' tls_cert_file, tls_key_file, tls_client_ca_file."""
    return server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)


def channel_credentials(ca_file: PathLike | None = None, cert_file: PathLike | None = None, key_file: PathLike | None = None,
                        root_certificates: bytes | None = None) -> grpc.ChannelCredentials:
    """TLS for a channel: the server is checked against ``ca_file`` / ``root_certificates`` (else the
    system's roots); ``cert_file`` and ``key_file`` are this side's certificate for mutual TLS."""
    cert, key = _read(cert_file, "TLS client certificate"), _read(key_file, "TLS client private key")
    if (cert is None) != (key is None):
        raise ValueError("a TLS client certificate needs its private key (and the key its certificate)")
    roots = root_certificates if root_certificates is not None else _read(ca_file, "TLS CA")
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)
