"""Mutual TLS for the API: the certificate files, re-read when they change, and the listener they serve.

`CertificateFiles` feeds gRPC's dynamic server credentials: on every new
connection it checks the certificate, key and client CA files and hands over
a new configuration when their contents changed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading

import grpc

from node_agent import errors

log = logging.getLogger(__name__)


class CertificateFiles:
    """The server's certificate chain, key and client CA, re-read when the files change.

    A change is noticed on the next new connection; a half-written pair (a
    key that does not match the certificate) is ignored until it is whole.
    """

    def __init__(self, cert: str, key: str, client_ca: str) -> None:
        self.paths = (cert, key, client_ca)
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._bad: tuple[tuple[int, int, int], ...] | None = None
        self._digest = ""
        self._error = ""
        self._lock = threading.Lock()
        try:
            first = self._read()
        except OSError as exc:
            raise errors.InvalidArgument(f"cannot read {exc.filename}: {exc.strerror}") from exc
        if first is None:
            raise errors.InvalidArgument(
                f"tls-cert {cert}, tls-key {key}, tls-client-ca {client_ca}: not a matching PEM certificate "
                f"and key and a PEM CA bundle ({self._error})"
            )
        self._initial = first

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for p in self.paths:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _contents(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for p in self.paths:
            with open(p, "rb") as fh:
                out.append(fh.read())
        return out[0], out[1], out[2]

    def _read(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._stat()
        cert, key, ca = self._contents()
        # The key must match the certificate, and the files must not have
        # changed while they were checked.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.paths[0], self.paths[1])
            ctx.load_verify_locations(cafile=self.paths[2])
        except (ssl.SSLError, OSError, ValueError) as exc:
            self._error = str(exc)
            if self._stamp is not None and stamp != self._bad:
                log.warning("TLS files not usable (yet), keeping the last good ones: %s", exc,
                            extra={"phase": "tls-reload"})
            self._bad = stamp
            return None
        if self._contents() != (cert, key, ca):
            return None
        self._stamp = stamp
        self._digest = hashlib.sha256(b"\0".join((cert, key, ca))).hexdigest()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed, else None (never raises)."""
        try:
            stamp = self._stat()
            if stamp in (self._stamp, self._bad):
                return None
            with self._lock:
                before = self._digest
                config = self._read()
            if config is None or self._digest == before:
                return None
            log.info("reloaded the TLS certificate, key and client CA", extra={"phase": "tls-reload"})
            return config
        except Exception as exc:  # noqa: BLE001 - runs on a gRPC thread; the old files stay in use
            log.warning("cannot reload TLS files: %s", exc, extra={"phase": "tls-reload"})
            return None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._initial, self.fetch, require_client_authentication=True)


def tls_port(server: grpc.aio.Server, listen: str, files: CertificateFiles) -> int:
    """Bind `listen` (HOST:PORT) on `server` with mutual TLS; returns the port."""
    from node_agent.config.validation import host_port

    host, port = host_port(listen)
    bound = server.add_secure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", files.credentials())
    if not bound:
        raise errors.FailedPrecondition(f"cannot listen on {listen}")
    return int(bound)
