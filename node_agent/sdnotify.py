"""systemd's readiness protocol (sd_notify), without libsystemd.

A service of `Type=notify` is started with `NOTIFY_SOCKET` in its
environment: the path of a datagram socket, or an abstract one written with a
leading `@`. The service sends newline-separated `KEY=VALUE` assignments in
one datagram each time its state changes (`READY=1` once it serves,
`STOPPING=1` when it begins to shut down, `STATUS=...` for humans).

Without `NOTIFY_SOCKET` (not under systemd) every call is a no-op. A failed
send is logged and never raised: readiness reporting must not take the
daemon down. Only the standard library; no other I/O than the one datagram.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

ENV = "NOTIFY_SOCKET"


def address(value: str) -> str | bytes | None:
    """The socket address named by a `NOTIFY_SOCKET` value, or None if unusable.

    `@name` is Linux's abstract namespace (a leading NUL byte); anything else
    must be an absolute path.
    """
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def notify(*assignments: str, env: dict[str, str] | None = None) -> bool:
    """Send `KEY=VALUE` lines to systemd; True when a datagram was sent."""
    value = (os.environ if env is None else env).get(ENV, "")
    if not value:
        return False
    addr = address(value)
    if addr is None:
        log.warning("ignoring %s=%r: neither an absolute path nor an @abstract name", ENV, value)
        return False
    payload = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.sendto(payload, addr)
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", value, exc)
        return False
    return True


def ready(status: str = "") -> bool:
    """The daemon serves: `READY=1` (and a status line, if given)."""
    return notify("READY=1", *([f"STATUS={status}"] if status else []))


def stopping(status: str = "") -> bool:
    """The daemon begins its shutdown: `STOPPING=1`."""
    return notify("STOPPING=1", *([f"STATUS={status}"] if status else []))
