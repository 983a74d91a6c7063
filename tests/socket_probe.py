"""A health check over a Unix socket from another process, run as another user with setpriv.

The agent's local socket admits peers by their credentials (SO_PEERCRED), so
the probe has to be a process of its own; its line is "OK" or the gRPC code
and details of the refusal.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import sys, grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        with grpc.insecure_channel("unix://" + sys.argv[1]) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
""")


def probe(sock: str, *setpriv: str) -> str:
    """The probe's line, run under `setpriv ARGS` when given (as this process's user otherwise)."""
    cmd = [sys.executable, "-c", PROBE, sock]
    if setpriv:
        cmd = ["setpriv", *setpriv, *cmd]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.strip()
