"""What the PodCheckpoint controller asks of this node's agent: checkpoint, push, find and remove its checkpoints.

The checkpoint goes through the agent's own `Checkpointer`, as any caller's
does (the node's namespace policy, the options checked, the pod frozen and
resumed under its watchdog), with the object's identity in its metadata.
A push goes only to a registry or repository `podcheckpoints.push-registries`
lists, with the node's own logins (`registry.credentials-file`, hosts.toml),
never credentials from the object; its result is the pushed manifest,
pinned by digest.
"""

from __future__ import annotations

from node_agent import errors
from node_agent.admission import parse_checkpoint_options
from node_agent.checkpointing import CheckpointRequest, Checkpointer
from node_agent.config.schema import Settings
from node_agent.podcheckpoints.model import KIND, PodCheckpoint
from node_agent.podcheckpoints.resolve import made_for
from node_agent.registry import Credentials
from node_agent.registry.reference import Reference, listed
from node_agent.store import Store
from node_agent.store.records import CheckpointRecord
from node_agent.transfers import PushRequest, Transfers


class NodeAgent:
    def __init__(self, settings: Settings, checkpointer: Checkpointer, transfers: Transfers, store: Store) -> None:
        self.settings = settings
        self.checkpointer = checkpointer
        self.transfers = transfers
        self.store = store

    async def checkpoint(self, pc: PodCheckpoint) -> CheckpointRecord:
        req = CheckpointRequest(
            pod=pc.pod, containers=pc.spec.containers, options=parse_checkpoint_options(dict(pc.spec.options)),
            requested_by={"kind": KIND, "namespace": pc.namespace, "name": pc.name, "uid": pc.uid})
        return await self.checkpointer.checkpoint(req)

    async def push(self, record: CheckpointRecord, reference: str) -> str:
        try:
            ref = Reference.parse(reference)
        except errors.AgentError as exc:
            raise errors.InvalidArgument(f"push reference {reference!r}: {exc}") from None
        allowed = self.settings.podcheckpoints.push_registries
        if not listed(ref, allowed):
            raise errors.PermissionDenied(
                f"{reference} is not in a registry or repository this node pushes PodCheckpoints to "
                f"(podcheckpoints.push-registries: {', '.join(allowed) or 'none'})")
        result = await self.transfers.push(PushRequest(record.id, reference, Credentials()), lambda _p: None)
        return f"{ref.registry}/{ref.repository}@{result.checkpoint_id}"

    def made_for(self, uid: str) -> list[CheckpointRecord]:
        """The checkpoints in this node's store taken for the PodCheckpoint with this UID."""
        return made_for(self.store, uid)

    def remove(self, record: CheckpointRecord) -> None:
        try:
            self.store.remove(record.id)
        except errors.NotFound:
            pass  # removed meanwhile (by hand, or by retention)
