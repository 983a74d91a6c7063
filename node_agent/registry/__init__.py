"""Checkpoints to and from OCI registries, through the distribution API.

Rule: the store is reached only through the small interfaces in ``ports``
(the store's ``Store`` provides them); HTTP lives in ``transport`` (over
``connection``, its errors worded in ``failures``), TLS in ``node_agent.tls``
and auth in ``auth``, on the standard library alone. Everything here is
synchronous and blocking, with a deadline on every request and a timeout on
every socket operation (the agent's ``registry:`` settings): async callers run
it in a worker thread. Credentials never reach a log record, a ``repr`` or an
error message, nor any host but the registry's own and the token realms it
may ask (docs/registry.md).
"""

from node_agent.registry.auth import Credentials
from node_agent.registry.ports import Admission, Progress, ProgressCallback, PullReport, PushReport
from node_agent.registry.pulling import pull
from node_agent.registry.pushing import push
from node_agent.registry.reference import Reference, parse_reference

__all__ = [
    "Admission",
    "Credentials",
    "Progress",
    "ProgressCallback",
    "PullReport",
    "PushReport",
    "Reference",
    "parse_reference",
    "pull",
    "push",
]
