"""Which pod a caller means: a sandbox ID, a unique ID prefix, or namespace/name.

Rule: one resolution for every path. The checkpointer and the API's
authorization gate both find the pod a request names here, from the
runtime's own list of sandboxes.
"""

from __future__ import annotations

import re
from typing import Callable

from node_agent import errors
from node_agent.cri.client import CriClient
from node_agent.cri.types import Pod


async def resolve_pod(cri: CriClient, ref: str, within: Callable[[str], bool] | None = None) -> Pod:
    """A pod by full sandbox ID, unique ID prefix, or namespace/name.

    `within`: only pods of the namespaces it accepts exist for this call (an
    authorization scope): the others are neither found nor counted.
    """
    ref = ref.strip()
    if not ref:
        raise errors.InvalidArgument("no pod given")
    pods = await cri.list_pods()
    if within is not None:
        pods = [p for p in pods if within(p.namespace)]
    if "/" in ref:
        ns, _, name = ref.partition("/")
        found = [p for p in pods if p.namespace == ns and p.name == name]
        ready = [p for p in found if p.ready]
        if not found:
            raise errors.NotFound(f"pod {ref} not found")
        if not ready:
            raise errors.FailedPrecondition(f"pod {ref} has no ready sandbox")
        if len(ready) > 1:
            raise errors.InvalidArgument(f"pod {ref} has {len(ready)} ready sandboxes; give a sandbox ID")
        return ready[0]
    exact = [p for p in pods if p.id == ref]
    if exact:
        return exact[0]
    if not re.fullmatch(r"[0-9a-f]{1,64}", ref):
        raise errors.NotFound(f"pod {ref!r} not found (give a sandbox ID, a unique ID prefix or namespace/name)")
    found = [p for p in pods if p.id.startswith(ref)]
    if not found:
        raise errors.NotFound(f"no pod sandbox ID starts with {ref}")
    if len(found) > 1:
        raise errors.InvalidArgument(f"pod ID prefix {ref} is ambiguous ({len(found)} sandboxes)")
    return found[0]
