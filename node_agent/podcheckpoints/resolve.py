"""Restore by name: `restore-from: podcheckpoint/<name>` names a PodCheckpoint in the Pod's own namespace.

It must have succeeded. On the node that took it, the checkpoint is the one
in this node's store whose metadata names the object's UID (the status's
checkpoint ID must be that one); anywhere else, its pushed copy
(`status.pushedReference`, pinned by digest). All agents share one
ServiceAccount, so any of them could have written that status: a pushed copy
is restored only with a trusted signature (`RestoreAdmission(signed=True)`),
whatever `restore.require-signature` says.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from node_agent import errors
from node_agent.config.schema import Settings
from node_agent.kubeapi import KubeClient, from_kubeconfig, in_cluster
from node_agent.podcheckpoints import model
from node_agent.podcheckpoints.model import KIND, SUCCEEDED, PodCheckpoint
from node_agent.store import Store
from node_agent.store.records import LOCAL, CheckpointRecord

PREFIX: Final = "podcheckpoint/"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PINNED = re.compile(r"@sha256:[0-9a-f]{64}$")


def named(ref: str) -> str | None:
    """The PodCheckpoint's name when ``ref`` is `podcheckpoint/<name>`; None for any other form."""
    if not ref.startswith(PREFIX):
        return None
    name = ref[len(PREFIX):]
    if len(name) > 253 or not _NAME.match(name):
        raise errors.InvalidArgument(f"{ref!r} does not name a PodCheckpoint (podcheckpoint/<name>)")
    return name


def cluster(settings: Settings) -> tuple[KubeClient, str] | str:
    """The API server's client and this node's name, or why there is none (the credentials of device
    taints: `devices.kubeconfig`, else the pod's service account)."""
    from node_agent.devices.monitor import node_name

    d = settings.devices
    creds = from_kubeconfig(d.kubeconfig) if d.kubeconfig else in_cluster()
    if creds is None:
        return "no cluster credentials (no devices.kubeconfig, not in a pod)"
    return KubeClient(creds, timeout=d.api_timeout), node_name(d.node_name)


def made_for(store: Store, uid: str) -> list[CheckpointRecord]:
    """The checkpoints in ``store`` taken here for the PodCheckpoint with this UID.

    Only checkpoints this node made count: a UID is no secret, and a pulled or
    imported checkpoint's metadata says whatever its maker wrote.
    """
    out = []
    for record in store.list():
        if record.provenance != LOCAL:
            continue
        asked = record.metadata.get("requested_by")
        if isinstance(asked, Mapping) and asked.get("kind") == KIND and asked.get("uid") == uid and uid:
            out.append(record)
    return out


@dataclass(frozen=True)
class Named:
    """What a PodCheckpoint name restores: a checkpoint in this node's store, or a pushed copy."""

    pc: PodCheckpoint
    checkpoint_id: str = ""
    reference: str = ""


def resolve(kube: KubeClient, node: str, store: Store, namespace: str, name: str) -> Named:
    """The checkpoint PodCheckpoint ``namespace``/``name`` restores on ``node`` (blocking)."""
    path = f"{model.API}/namespaces/{namespace}/{model.PLURAL}/{urllib.parse.quote(name, safe='')}"
    try:
        pc = model.parse(kube.request("GET", path))
    except errors.NotFound:
        raise errors.FailedPrecondition(f"podcheckpoint {namespace}/{name} does not exist") from None
    if pc.namespace != namespace:
        raise errors.FailedPrecondition(f"podcheckpoint {namespace}/{name} does not exist")
    if pc.status.phase != SUCCEEDED:
        said = f": {pc.status.message}" if pc.status.message else ""
        raise errors.FailedPrecondition(
            f"{pc.where} has not succeeded (phase {pc.status.phase or 'none yet'}{said})")
    if pc.status.node == node:
        for record in made_for(store, pc.uid):
            if record.id == pc.status.checkpoint_id:
                return Named(pc, checkpoint_id=record.id)
    if pc.status.pushed:
        if not _PINNED.search(pc.status.pushed) or not pc.status.pushed.endswith(pc.status.checkpoint_id):
            raise errors.FailedPrecondition(
                f"{pc.where}: its pushed reference {pc.status.pushed!r} is not its checkpoint pinned by digest")
        return Named(pc, reference=pc.status.pushed)
    raise errors.FailedPrecondition(
        f"{pc.where} was taken on node {pc.status.node or '?'} and not pushed: only that node restores it "
        "(push it: spec.push)")
