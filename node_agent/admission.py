"""The rules a checkpoint or a restore must pass before anything is touched, and their options.

Rule: each rule has one home, here, and is evaluated once per request,
whichever entry path asks first: the API's Checkpoint and Restore, the CRI
endpoint's CheckpointPod and RestorePod, and restore through a Pod's
annotations. Options are parsed once, at the entry path, and handed on
parsed (`CheckpointOptions`, `RestoreOptions`). A restore's rules, in order:
the namespace's policy (`namespaces:`), a checkpoint imported from another
engine's archive (`restore.allow-foreign`), a trusted signature when
`restore.require-signature` is set, and host access (`hostaccess`, through
`podformat.check_host_access`); `RestoreAdmission` holds one request's
answers, so that a rule an entry path asked early is not asked again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from criu_bridge.runtime import CheckpointFlags
from node_agent import errors, policy, signing
from node_agent.config.schema import Settings
from node_agent.cri import Pod
from node_agent.interop.foreign import IMPORTED_FROM
from node_agent.options import boolean
from node_agent.podformat import SavedPod, check_host_access, parse_all_options
from node_agent.store import CheckpointRecord

# allow-host-access: let a checkpoint's configs reach into the host (host
# mounts, devices, privileged mode, host namespaces, added capabilities;
# `hostaccess`), refused by default: a checkpoint is hostile input.
# lazy: start the containers before their memory is read (default: the
# lazy-restore setting, where CRIU and the kernel support it).
# Both take `true` or `false`, nothing else.
RESTORE_OPTIONS = {"allow-host-access", "lazy"}


@dataclass(frozen=True)
class RestoreOptions:
    allow_host_access: bool = False
    lazy: bool | None = None  # None: the node's default


def parse_restore_options(options: Mapping[str, str]) -> RestoreOptions:
    """A restore's options, strictly: known keys, values `true` or `false`."""
    values: dict[str, bool] = {}
    for key, value in options.items():
        if key not in RESTORE_OPTIONS:
            raise errors.InvalidArgument(
                f"unknown restore option {key!r} (supported: {', '.join(sorted(RESTORE_OPTIONS))})"
            )
        values[key.replace("-", "_")] = boolean(value, f"restore option {key!r}")
    return RestoreOptions(**values)


@dataclass(frozen=True)
class CheckpointOptions:
    flags: CheckpointFlags  # runc's flags, the defaults for what was not given
    pre_dump: bool | None = None  # None: the node's pre-dump setting


def parse_checkpoint_options(options: Mapping[str, str]) -> CheckpointOptions:
    """A new checkpoint's options, strictly (`podformat.parse_all_options`)."""
    flags, pre_dump = parse_all_options(options)
    return CheckpointOptions(flags, pre_dump)


def require_checkpoint(settings: Settings, pod: Pod) -> None:
    """May `pod` be checkpointed? The node's policy for its namespace; PERMISSION_DENIED if not."""
    policy.require(settings, "checkpoint", pod.namespace, pod.ref)


class RestoreAdmission:
    """One restore request's rules for the pod `where` in `namespace`, each evaluated once.

    Blocking (reads signatures): call from a worker thread where a store is read.
    """

    def __init__(self, settings: Settings, namespace: str, where: str,
                 options: RestoreOptions = RestoreOptions()) -> None:
        self.settings = settings
        self.namespace = namespace
        self.where = where
        self.options = options
        self._policy = False
        self._admitted: dict[str, str] = {}  # checkpoint ID -> the signer's key id
        self._host_access: set[str] = set()  # checkpoint IDs whose configs passed
        self._signed = False  # a trusted signature is required whatever restore.require-signature says

    def require_policy(self) -> None:
        """The namespace's restore policy (`namespaces:`)."""
        if not self._policy:
            policy.require(self.settings, "restore", self.namespace, self.where)
            self._policy = True

    def require_pod_host_access(self) -> None:
        """A Pod's annotation allows host access: only in `restore.pod-host-access-namespaces`."""
        if self.options.allow_host_access:
            policy.require_pod_host_access(self.settings, self.namespace, self.where)

    def require_signed(self) -> None:
        """From now on, admit only checkpoints with a trusted signature (a copy the request found through
        something any node may have written: a PodCheckpoint's pushed reference)."""
        self._signed = True

    def admit(self, signatures: signing.ReferrerReader, record: CheckpointRecord, saved: SavedPod) -> str:
        """May `record` be restored here? PERMISSION_DENIED if not; the signer's key id ("" when none is required).

        In order: the namespace's policy, a checkpoint imported from another
        engine's archive (`restore.allow-foreign`), a trusted signature when
        `restore.require-signature` is set, read from `signatures` (the
        store, or a pull not yet published).
        """
        if record.id in self._admitted:
            return self._admitted[record.id]
        self.require_policy()
        rules = self.settings.restore
        engine = foreign_engine(record, saved)
        if engine and not rules.allow_foreign:
            raise errors.PermissionDenied(
                f"restore as pod {self.where}: checkpoint {record.id} was imported from another engine's archive "
                f"({engine}), not made by node-agent; this node restores such checkpoints only with "
                "restore.allow-foreign: true"
            )
        signer = ""
        if rules.require_signature or self._signed:
            signer = signing.require_trusted(signatures, record, self.settings, self.namespace)
        self._admitted[record.id] = signer
        return signer

    def check_host_access(self, record: CheckpointRecord, saved: SavedPod) -> None:
        """The checkpoint's configs reach into the host only where the options allow it (`hostaccess`)."""
        if record.id not in self._host_access:
            check_host_access(record.id, saved, self.settings, allowed=self.options.allow_host_access)
            self._host_access.add(record.id)


def admit(settings: Settings, signatures: signing.ReferrerReader, record: CheckpointRecord, saved: SavedPod,
          namespace: str, where: str) -> str:
    """May `record` be restored into `namespace` (as pod `where`)? PERMISSION_DENIED if not (blocking).

    `RestoreAdmission.admit` for one question. Returns the signer's key id
    ("" when no signature is required).
    """
    return RestoreAdmission(settings, namespace, where).admit(signatures, record, saved)


def foreign_engine(record: CheckpointRecord, saved: SavedPod) -> str:
    """The engine whose archive the checkpoint was imported from ("" for node-agent's own).

    Import records it twice (`interop.plans`): the metadata's `imported.format`
    (`node-agent` for the agent's own archives) and an annotation on the pod
    and container configs, which an export and a re-import keep.
    """
    imported = record.metadata.get("imported") if isinstance(record.metadata, Mapping) else None
    if imported is not None:
        fmt = imported.get("format") if isinstance(imported, Mapping) else None
        if fmt != "node-agent":
            return fmt if isinstance(fmt, str) and fmt else "unknown"
    for cfg in (saved.pod_config, *(c["config"] for _, c, _ in saved.containers)):
        annotations = cfg.get("annotations")
        engine = annotations.get(IMPORTED_FROM) if isinstance(annotations, Mapping) else None
        if engine:
            return str(engine)
    return ""
