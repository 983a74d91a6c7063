"""A restored container's image: the checkpoint's own, on this node, pulled when a restore must pull it.

Rule: a process restored on another image's files would find other files under its open ones, so the
image a restored container gets must be the one it was checkpointed on, by image ID or repo digest. Where
the kubelet restores (a Pod annotated `restore-from`) it pulls each container's image after RunPodSandbox,
and CreateContainer checks it (`check_image`). A restore no kubelet precedes (the CLI, the API) pulls a
missing image itself through CRI PullImage, with the node's login for that registry (`ensure_image`),
as the kubelet would.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from node_agent import errors
from node_agent.config.schema import Settings
from node_agent.cri import CriClient
from node_agent.podformat import SavedPod
from node_agent.registry.endpoints import RegistryAccess
from node_agent.store import CheckpointRecord

log = logging.getLogger(__name__)


def saved_image(record: CheckpointRecord, cname: str, cfg: Mapping[str, Any]) -> str:
    """The image a checkpointed container ran, as its saved config names it."""
    image = str((cfg["config"].get("image") or {}).get("image") or cfg.get("rootfsImageName") or "")
    if not image:
        raise errors.DataLoss(f"checkpoint {record.id}: container {cname} names no image")
    return image


async def ensure_image(cri: CriClient, settings: Settings, record: CheckpointRecord, cname: str, image: str) -> None:
    """`image` on this node: pulled through CRI PullImage, with the node's login for its registry, if absent."""
    if await cri.image_present(image):
        return
    login = RegistryAccess.of(settings.registry).image_login(image)
    log.info("restore of %s: pulling image %s (container %s), which this node does not have%s",
             record.id, image, cname, " (with the node's login for its registry)" if login else "",
             extra={"checkpoint": record.id, "container": cname, "phase": "image"})
    try:
        await cri.pull_image(image, username=login.username if login else "",
                             password=login.password if login else "", timeout=settings.timeouts.restore)
    except errors.AgentError as exc:
        # A registry that wants a login, or refuses the one sent, says so; any other failure (containerd
        # answers most with UNKNOWN) leaves the image missing: a precondition of the restore, not a fault.
        kind = type(exc) if isinstance(exc, (errors.Unauthenticated, errors.PermissionDenied)) else \
            errors.FailedPrecondition
        raise kind(f"restore of {record.id}: image {image} (container {cname}) is not on this node, "
                   f"and pulling it failed: {exc}") from exc


async def check_image(cri: CriClient, record: CheckpointRecord, saved: SavedPod, cname: str, image: str) -> None:
    """The image the kubelet gives container `cname` is on this node and is the checkpoint's own.

    FAILED_PRECONDITION otherwise, naming both.
    """
    cfg = next((c for n, c, _ in saved.containers if n == cname), None)
    if cfg is None:
        raise errors.Internal(f"checkpoint {record.id} has no container {cname}")
    found, digests = await cri.image_ids(image)
    if not found:
        raise errors.FailedPrecondition(
            f"restore of {record.id}: image {image} (container {cname}) is not on this node; the kubelet "
            "pulls a container's image before it creates the container")
    wanted = str(cfg.get("rootfsImageRef") or "")
    known = {found, *digests, *(d.rpartition("@")[2] for d in digests)}
    if wanted and wanted not in known and wanted.rpartition("@")[2] not in known:
        raise errors.FailedPrecondition(
            f"restore of {record.id}: container {cname} was checkpointed on image {wanted}, but image "
            f"{image} is {found} on this node")
