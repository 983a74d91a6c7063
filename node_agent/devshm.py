"""The pod's own /dev/shm: found in a container's OCI spec, captured with the pod, put back in the new sandbox.

containerd gives each sandbox a tmpfs of its own and bind-mounts it at
every container's /dev/shm. A checkpoint keeps its content as a diff
(`criu_bridge.rootfs`, at `podformat.POD_DEVSHM`); a restore applies that
diff to the new sandbox's tmpfs before any container is created. A
container whose /dev/shm is the host's, or no bind mount at all, has none
of the pod's own to keep.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping

from criu_bridge.errors import BridgeError
from criu_bridge.rootfs.apply import apply_diff
from criu_bridge.rootfs.capture import capture_diff
from node_agent import errors, podformat
from node_agent.cri import CriClient


def shm_source(spec: Mapping[str, Any]) -> str | None:
    """The host directory behind a container's /dev/shm, if it is the pod's own."""
    for m in spec.get("mounts") or []:
        if m.get("destination") == "/dev/shm" and m.get("type") == "bind":
            src = str(m.get("source", ""))
            if src.startswith("/") and src.rstrip("/") != "/dev/shm":
                return src
    return None


async def capture(src: str, work: str) -> None:
    """Write the diff of the pod's /dev/shm at `src` into the checkpoint's work tree."""
    try:
        await asyncio.to_thread(
            capture_diff, src, os.path.join(work, podformat.POD_DEVSHM),
            os.path.join(work, podformat.POD_DEVSHM_DELETED),
        )
    except BridgeError as exc:
        raise errors.FailedPrecondition(f"cannot capture the pod's /dev/shm ({src}): {exc}") from exc


async def restore(cri: CriClient, staging: str, pod_id: str, where: str) -> None:
    """Apply a staged checkpoint's /dev/shm, if it has one, to the new sandbox `pod_id`."""
    tar = os.path.join(staging, podformat.POD_DEVSHM)
    if not os.path.exists(tar):
        return
    detail = await cri.pod_status(pod_id)
    target = shm_source(detail.spec)
    if not target or not os.path.isdir(target):
        raise errors.FailedPrecondition(f"restore as pod {where}: cannot find the new sandbox's /dev/shm")
    try:
        await asyncio.to_thread(apply_diff, target, tar, None)
    except BridgeError as exc:
        raise errors.DataLoss(f"restore as pod {where}: the checkpoint's /dev/shm is unusable: {exc}") from exc
