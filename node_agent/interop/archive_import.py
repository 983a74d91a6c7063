"""A container checkpoint archive, read as hostile input, stored as a pod checkpoint.

One import, four steps, each in its own module:

- `archive`: the archive (plain, gzip or zstd) is read once, or twice when
  its bulk comes before the documents it must have; every member header is
  checked and the members kept are staged;
- `staging`: they land in flat, numbered files of a private directory under
  the store's work area, every byte counted first against the bounds and
  the filesystem's free space;
- `plans`: the staged members are mapped to the store paths of the pod
  checkpoint format (`podformat`), node-agent's own archives undone file for
  file, other engines' given CRI configs and this node's CPU description;
  containerd's writable layer is turned into a diff by `layer`;
- here: the plan goes into a store writer, and the staging directory is
  removed whatever happened.

Nested archives (`rootfs-diff.tar`, `devshm-checkpoint.tar`) stay archives:
they are scanned so a bad one is refused early, and are applied only at
restore, by `criu_bridge.rootfs.apply.apply_diff`, with its own checks.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from node_agent import errors
from node_agent.interop import common as c
from node_agent.interop import foreign
from node_agent.interop.archive import Archive, read_members
from node_agent.interop.plans import Out, foreign_plan, own_plan
from node_agent.interop.landing import Meter, Staging, free_bytes
from node_agent.podformat import manifest_annotations
from node_agent.store import CheckpointRecord, Store
from node_agent.store.records import IMPORTED
from node_agent.store.sealing import SealKey

# The key a namespace's checkpoints are encrypted under (None: in the clear).
SealFor = Callable[[str], SealKey | None]


def _default_cpuinfo(criu: str, work: str) -> Callable[[str], None]:
    def dump(images_dir: str) -> None:
        log_dir = os.path.join(work, "cpuinfo-work")
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        try:
            cp = subprocess.run(
                [criu, "cpuinfo", "dump", "-D", images_dir, "-W", log_dir, "-o", "cpuinfo-dump.log"],
                stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise errors.FailedPrecondition(f"cannot run {criu} cpuinfo dump: {exc}") from exc
        if cp.returncode != 0:
            tail = (cp.stderr or cp.stdout).decode(errors="replace").strip()[-500:]
            raise errors.FailedPrecondition(f"{criu} cpuinfo dump failed ({cp.returncode}): {tail}")

    return dump


def _commit(
    store: Store, staging: Staging, plan: list[Out], meta: dict[str, Any], seal_for: SealFor | None
) -> CheckpointRecord:
    seal = seal_for(str(meta["pod"]["namespace"])) if seal_for is not None else None
    with store.writer(seal=seal) as w:
        for out in sorted(plan, key=lambda o: o.path):
            if out.is_dir:
                w.add_dir(out.path, mode=out.mode)
            elif out.data is not None:
                w.add_bytes(out.path, out.data, mode=out.mode)
            else:
                if out.staged is None:
                    raise errors.Internal(f"no content staged for {out.path}")
                w.add_file(out.path, staging.path(out.staged), mode=out.mode)
        # Made elsewhere: the store records it as imported (retention never prefers it to the node's own).
        return w.commit(meta, annotations=manifest_annotations(meta), provenance=IMPORTED)


def import_archive(
    store: Store,
    path: str,
    *,
    namespace: str | None = None,
    name: str | None = None,
    container_name: str | None = None,
    image: str | None = None,
    cgroup_parent: str | None = None,
    log_root: str | None = None,
    runtime_handler: str = "",
    volumes: Mapping[str, str] | None = None,
    options: Mapping[str, str] | None = None,
    allow_host_access: bool = False,
    kubelet_root: str = "/var/lib/kubelet",
    criu: str = "criu",
    cpuinfo_dump: Callable[[str], None] | None = None,
    work_dir: str | None = None,
    limits: c.ImportLimits = c.ImportLimits(),
    seal_for: SealFor | None = None,
) -> CheckpointRecord:
    """Take a container checkpoint archive into the store as a one-container pod checkpoint.

    `namespace` and `name` set the pod's namespace and name (a foreign
    archive has none: "default" and the container's name are used).
    For foreign archives only: `container_name`, `image` (default: the
    archive's), `cgroup_parent` and `log_root` (parent of the pod's log
    directory, default /var/log/pods) of the pod to restore, `volumes`
    (container path -> host path for the container's own bind mounts),
    `options` (checkpoint options the restore needs, e.g. tcp-established),
    and `criu` or `cpuinfo_dump` to describe this node's CPU. For
    node-agent archives, `log_root` (when given) must hold the pod's log
    directory, and whatever in the configs reaches into the host
    (`node_agent.hostaccess`: mounts outside the pod's own volumes under
    `kubelet_root`, devices, privileged mode, ...) is refused unless
    `allow_host_access`. `seal_for` gives the key a namespace's checkpoints
    are encrypted under (None: stored in the clear).
    """
    if namespace is not None:
        c.check_name(namespace, "namespace")
    if name is not None:
        c.check_name(name, "pod name")
    work = work_dir or os.path.join(store.root, "work")
    cleanup: list[str] = []
    archive = Archive(path)
    staging: Staging | None = None
    try:
        try:
            staging = Staging(work)
        except OSError as exc:
            raise errors.Internal(f"cannot make a staging directory under {work}: {exc.strerror}") from exc
        try:
            bounds = limits.bounds(free_bytes(staging.fd))
            meter = Meter(staging.fd, work, limits, bounds)
            entries = read_members(archive, staging, meter, limits, bounds)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise errors.ResourceExhausted(f"no space to stage the archive under {work}") from exc
            raise errors.Internal(f"reading archive {path}: {exc}") from exc
        if c.OWN_MANIFEST in entries:
            plan, meta = own_plan(
                staging, entries, limits, bounds, namespace=namespace, name=name, log_root=log_root,
                allow_host_access=allow_host_access, kubelet_root=kubelet_root, store_root=store.root,
            )
        else:
            opts = foreign.ForeignOptions(
                namespace=namespace, name=name, container_name=container_name, image=image,
                cgroup_parent=cgroup_parent, log_root=log_root, runtime_handler=runtime_handler,
                volumes=dict(volumes or {}),
            )
            plan, meta = foreign_plan(
                store, staging, meter, entries, limits, bounds, opts, options or {},
                cpuinfo_dump or _default_cpuinfo(criu, staging.root), cleanup,
            )
        record = _commit(store, staging, plan, meta, seal_for)
        cleanup.clear()
        return record
    finally:
        archive.close()
        if staging is not None:
            staging.close()
        for leftover in cleanup:
            shutil.rmtree(leftover, ignore_errors=True)
