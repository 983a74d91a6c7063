"""TLS for the agent's clients (the registry transport, the Kubernetes client).

Rule: one way to build a client context and one way to name a TLS failure.
A context verifies its peer unless ``Trust.insecure`` says otherwise; CA
certificates given either join the system's trust store or replace it, as the
caller's rule says. A setting that cannot be used is a ``TrustError`` naming
it; the caller decides the error class. A failed handshake or exchange becomes
an ``AgentError`` here, with the ssl error's reason and never a key.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass

from node_agent.errors import AgentError, FailedPrecondition, Unavailable


@dataclass(frozen=True)
class Trust:
    """What a client trusts and shows.

    ``ca_file`` and ``ca_pem`` (PEM text) are CA certificates; with
    ``keep_system_ca`` they join the system's trust store (a registry's rule),
    otherwise they replace it when given (a kubeconfig's rule). A client key
    pair is ``cert_file`` and ``key_file``, or ``cert_pem`` and ``key_pem``
    (ssl loads key pairs from files only, so those are written to a private
    directory that lives while they are loaded). ``insecure`` verifies nothing.
    """

    ca_file: str = ""
    ca_pem: str = ""
    keep_system_ca: bool = False
    cert_file: str = ""
    key_file: str = ""
    cert_pem: bytes = b""
    key_pem: bytes = b""
    insecure: bool = False


class TrustError(Exception):
    """A TLS setting that cannot be used: the text names it, ``reason`` is the ssl or OS error's own."""

    def __init__(self, message: str, reason: Exception) -> None:
        super().__init__(message)
        self.reason = reason


def client_context(trust: Trust, peer: str) -> ssl.SSLContext:
    """A client context for ``trust``; ``peer`` (``registry``, ``API server``) names whose CA a message speaks of."""
    if trust.keep_system_ca:
        ctx = ssl.create_default_context()
        if trust.ca_file:
            try:
                ctx.load_verify_locations(cafile=trust.ca_file)
            except FileNotFoundError as exc:
                raise TrustError(f"CA file {trust.ca_file} does not exist", exc) from None
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise TrustError(f"CA file {trust.ca_file} is not a usable PEM bundle: {exc}", exc) from None
        if trust.ca_pem:
            try:
                ctx.load_verify_locations(cadata=trust.ca_pem)
            except (OSError, ValueError) as exc:
                raise TrustError(f"the {peer} CA bundle given is not a usable PEM bundle: {exc}", exc) from None
    else:
        try:
            ctx = ssl.create_default_context(cafile=trust.ca_file or None, cadata=trust.ca_pem or None)
        except (OSError, ValueError) as exc:
            raise TrustError(f"the {peer} CA certificates given are not usable: {exc}", exc) from None
    if trust.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        _load_key_pair(ctx, trust)
    except (OSError, ValueError) as exc:
        raise TrustError(f"the client certificate for the {peer} is not usable: {exc}", exc) from None
    return ctx


def _load_key_pair(ctx: ssl.SSLContext, trust: Trust) -> None:
    if trust.cert_file:
        ctx.load_cert_chain(trust.cert_file, trust.key_file or None)
    elif trust.cert_pem:
        with tempfile.TemporaryDirectory(prefix="node-agent-tls-") as tmp:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            for path, data in ((cert, trust.cert_pem), (key, trust.key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            ctx.load_cert_chain(cert, key if trust.key_pem else None)


def failure(exc: ssl.SSLError, where: str, peer: str, *, ca_hint: str = "", verbatim: bool = False) -> AgentError:
    """The AgentError for a TLS failure with ``peer`` (a host:port or URL) while doing ``where``.

    With ``ca_hint`` (where to give the CA), an untrusted certificate is
    FailedPrecondition; anything else is Unavailable, with the ssl error's
    reason (and a hint when the peer seems to speak plain HTTP), or with
    its whole text when ``verbatim``.
    """
    if ca_hint and isinstance(exc, ssl.SSLCertVerificationError):
        return FailedPrecondition(
            f"{where}: the TLS certificate of {peer} is not trusted ({exc.verify_message}); {ca_hint}"
        )
    if verbatim:
        return Unavailable(f"{where}: TLS with {peer} failed: {exc}")
    hint = " (it may serve plain HTTP)" if exc.reason == "WRONG_VERSION_NUMBER" else ""
    return Unavailable(f"{where}: TLS with {peer} failed: {exc.reason or exc}{hint}")
