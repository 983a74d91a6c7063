"""What a failed registry exchange says: the AgentError, its message, the log line.

Rule: every network or HTTP failure becomes one ``AgentError`` naming the
registry and repository (``where``); a registry-supplied string reaches a
message only after ``clean``; a log line names the reference and why, never a
credential, a query string or a header value.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl

from node_agent import tls
from node_agent.errors import (
    AgentError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from node_agent.registry.connection import Origin, Overdue
from node_agent.registry.reference import Reference


def clean(text: str, limit: int = 300) -> str:
    """A registry-supplied string made safe and short for an error message."""
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_detail(body: bytes) -> str:
    """``CODE: message`` items of an OCI error body, or its first line of text."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("errors"), list):
        items = []
        for err in doc["errors"][:3]:
            if isinstance(err, dict):
                code, message = err.get("code"), err.get("message")
                items.append(clean(f"{code if isinstance(code, str) else '?'}: {message if isinstance(message, str) else ''}", 200))
        if items:
            return "; ".join(items)
    line = body.decode("utf-8", "replace").strip().splitlines()[:1]
    return clean(line[0], 200) if line else ""


def log_failure(logger: logging.Logger, op: str, ref: object, exc: BaseException) -> None:
    """One warning line for a push or pull that did not finish: the reference, and why (never a credential)."""
    name = str(ref) if isinstance(ref, Reference) else clean(str(ref), 300)
    if isinstance(exc, DeadlineExceeded):
        how = "timed out"
    elif isinstance(exc, (Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)) or type(exc).__name__ == "CancelledError":
        how = "was cancelled"  # CancelledError: asyncio's or concurrent.futures', whichever reached this thread
    else:
        how = "failed"
    code = exc.code if isinstance(exc, AgentError) else type(exc).__name__
    detail = clean(str(exc), 1000)
    logger.warning("%s of %s %s (%s)%s", op, name, how, code, f": {detail}" if detail else "", extra={"phase": op})


def network_error(exc: BaseException, where: str, origin: Origin, io_timeout: float, what: str) -> AgentError:
    """The AgentError for a network failure with ``origin`` while doing ``what``."""
    if isinstance(exc, AgentError):
        return exc
    if isinstance(exc, Overdue):
        return exc.deadline.error(where)
    if isinstance(exc, ssl.SSLError):
        return tls.failure(exc, where, origin.netloc, ca_hint="give the CA that signed it as the CA file")
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded(f"{where}: {origin.netloc} did not answer within {io_timeout:g}s ({what})")
    if isinstance(exc, ConnectionRefusedError):
        return Unavailable(f"{where}: {origin.netloc} refused the connection; is the registry running there?")
    if isinstance(exc, socket.gaierror):
        return Unavailable(f"{where}: cannot resolve {origin.host}: {exc.strerror}")
    if isinstance(exc, http.client.HTTPException):
        return Unavailable(f"{where}: {origin.netloc} broke the HTTP exchange ({type(exc).__name__}, {what})")
    if isinstance(exc, OSError):
        return Unavailable(f"{where}: connection to {origin.netloc} failed ({what}): {exc.strerror or exc}")
    return Unavailable(f"{where}: {what} failed: {type(exc).__name__}")


def status_error(where: str, status: int, what: str, detail: str) -> AgentError:
    """The AgentError for an HTTP status the caller did not expect."""
    text = f"{where}: {what}: HTTP {status}" + (f" ({detail})" if detail else "")
    if status == 401:
        return Unauthenticated(text)
    if status == 403:
        return PermissionDenied(text)
    if status == 404:
        return NotFound(text)
    if status in (413, 429):
        return ResourceExhausted(text)
    if status == 400 and "HTTP request to an HTTPS server" in detail:
        return FailedPrecondition(f"{where}: the registry speaks HTTPS; do not ask for plain HTTP")
    if status >= 500:
        return Unavailable(text)
    return FailedPrecondition(text)
