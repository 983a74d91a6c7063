"""Removing everything a bed may have left behind.

Its containerd (gracefully first), shims and runc containers (paused ones
thawed), processes left in its cgroups, mounts, shim sockets in containerd's
global /run/containerd/s, its bridge, libcni's cached results, its cgroups
and its directories. Only what can be told to be this bed's is touched.

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterable
from typing import Any

from node_agent.containerd import all_runtimes
from testbed.host import (
    TestbedError,
    alive,
    arg_value,
    cwd_of,
    kill,
    link_exists,
    log,
    mountpoints,
    program_name,
    read_argv,
    run,
    under,
    unmount_under,
    wait_gone,
    write_plain,
)
from testbed.layout import (
    CNI_RESULTS_DIR,
    K8S_NAMESPACE,
    SYSTEM_RUNC_ROOT,
    BedLayout,
    claimed_indexes,
)

STOP_TIMEOUT_S = 10.0


def bed_processes(bed: BedLayout) -> dict[int, str]:
    """Processes that belong to this bed, by kind."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        argv = read_argv(pid)
        if not argv:
            continue
        prog = program_name(argv)
        if prog == "containerd" and arg_value(argv, "--config", "-c") == bed.config:
            found[pid] = "containerd"
        elif prog.startswith("containerd-shim") and arg_value(argv, "-address", "--address") == bed.socket:
            found[pid] = "shim"
        elif prog.startswith("containerd-shim") and under(cwd_of(pid), bed.state):
            found[pid] = "shim"
        elif prog == "runc" and under(arg_value(argv, "--root"), bed.state):
            found[pid] = "runc"
        elif prog == "ctr" and arg_value(argv, "--address", "-a") == bed.socket:
            found[pid] = "ctr"
    return found


def containerd_pid(bed: BedLayout) -> int | None:
    for pid, kind in bed_processes(bed).items():
        if kind == "containerd":
            return pid
    return None


def runc_containers(root: str) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for cid in names:
        try:
            with open(os.path.join(root, cid, "state.json")) as f:
                out.append((cid, json.load(f)))
        except (OSError, ValueError):
            out.append((cid, {}))
    return out


def runc_bundle_paths(state: dict[str, Any]) -> list[str]:
    config = state.get("config") or {}
    paths = [config.get("rootfs") or ""]
    for label in config.get("labels") or []:
        if label.startswith("bundle="):
            paths.append(label[len("bundle="):])
    return [p for p in paths if p]


def runtime_roots(bed: BedLayout) -> list[str]:
    """runc roots (with the namespace joined) that may hold this bed's containers."""
    roots = set()
    for parent in [bed.runc_base] + configured_runc_roots(bed):
        try:
            for ns in os.listdir(parent):
                if os.path.isdir(os.path.join(parent, ns)):
                    roots.add(os.path.join(parent, ns))
        except OSError:
            pass
    return sorted(roots)


def configured_runc_roots(bed: BedLayout) -> list[str]:
    try:
        with open(bed.config, "rb") as f:
            config = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return []
    roots = []
    for rt in all_runtimes(config).values():
        root = (rt.get("options") or {}).get("Root") if isinstance(rt, dict) else None
        if isinstance(root, str) and root:
            roots.append(root)
    roots.append(SYSTEM_RUNC_ROOT)
    return roots


def resume_runc_containers(bed: BedLayout) -> None:
    """Thaws this bed's paused containers. Pausing through runc directly is
    invisible to containerd, and a frozen process cannot be killed."""
    for root in runtime_roots(bed):
        if not os.path.isdir(root):
            continue
        proc = run([bed.runc_bin, "--root", root, "list", "--format", "json"], timeout=30, check=False)
        try:
            listed = json.loads(proc.stdout or b"null") or []
        except ValueError:
            continue
        for entry in listed:
            if entry.get("status") not in ("paused", "pausing"):
                continue
            if under(root, bed.state) or under(entry.get("bundle"), bed.state):
                log(f"{bed.runc_bin} --root {root} resume {entry.get('id')}")
                run([bed.runc_bin, "--root", root, "resume", str(entry.get("id"))], timeout=30, check=False)


def delete_runc_containers(bed: BedLayout) -> None:
    for root in runtime_roots(bed):
        ours = under(root, bed.state)
        for cid, state in runc_containers(root):
            if not ours and not any(under(p, bed.state) for p in runc_bundle_paths(state)):
                continue
            log(f"{bed.runc_bin} --root {root} delete -f {cid}")
            proc = run([bed.runc_bin, "--root", root, "delete", "--force", cid], timeout=30, check=False)
            if proc.returncode != 0 and os.path.exists(os.path.join(root, cid)):
                # A container whose init is gone but whose state remains.
                pid = state.get("init_process_pid")
                if isinstance(pid, int) and pid > 1 and alive(pid) and ours:
                    kill([pid], signal.SIGKILL)
                    wait_gone([pid], 5)
                    run([bed.runc_bin, "--root", root, "delete", "--force", cid], timeout=30, check=False)
                if ours:
                    shutil.rmtree(os.path.join(root, cid), ignore_errors=True)


def cgroup_dirs(bed: BedLayout) -> list[str]:
    dirs = []
    for point, fstype in mountpoints():
        if fstype in ("cgroup", "cgroup2"):
            path = point + bed.cgroup_parent
            if os.path.isdir(path):
                dirs.append(path)
    return dirs


def kill_cgroups(bed: BedLayout) -> None:
    pids = []
    for top in cgroup_dirs(bed):
        for dirpath, _, files in os.walk(top):
            for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                if name in files:
                    try:
                        write_plain(os.path.join(dirpath, name), value)
                    except OSError:
                        pass
            try:
                with open(os.path.join(dirpath, "cgroup.procs")) as f:
                    pids += [int(x) for x in f.read().split()]
            except OSError:
                pass
    if pids:
        log(f"killing {len(pids)} processes left in {bed.cgroup_parent}")
        kill(pids, signal.SIGKILL)
        wait_gone(pids, 5)


def remove_cgroups(bed: BedLayout) -> None:
    for top in cgroup_dirs(bed):
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
        parent = os.path.dirname(top)
        try:
            os.rmdir(parent)  # the shared /node-agent-testbed level, once empty
        except OSError:
            pass


def shim_tasks(bed: BedLayout) -> set[tuple[str, str]]:
    """(namespace, id) of this bed's running shims, from their command lines."""
    found = set()
    for pid, kind in bed_processes(bed).items():
        if kind == "shim":
            argv = read_argv(pid)
            ns, sid = arg_value(argv, "-namespace", "--namespace"), arg_value(argv, "-id", "--id")
            if ns and sid:
                found.add((ns, sid))
    return found


def shim_sockets(bed: BedLayout, tasks: Iterable[tuple[str, str]] = (), ids: Iterable[str] = ()) -> list[str]:
    """Shim sockets of this bed (they live in containerd's global /run/containerd/s):
    those named in its task dirs, and those of the shims `tasks` (namespace, id)
    and of the sandbox and container `ids`. The name hashes the bed's own socket
    path, so these are never another containerd's. A containerd 2.x shim does not
    exit when its tasks are removed through ctr (only CRI shuts it down); killed,
    it leaves its socket behind."""
    socks = set()
    for ns, sid in tasks:
        digest = hashlib.sha256(os.path.join(bed.socket, ns, sid).encode()).hexdigest()
        socks.add(os.path.join("/run/containerd/s", digest))
    for sid in ids:
        digest = hashlib.sha256(os.path.join(bed.socket, K8S_NAMESPACE, sid).encode()).hexdigest()
        socks.add(os.path.join("/run/containerd/s", digest))
    try:
        namespaces = os.listdir(bed.task_dir)
    except OSError:
        namespaces = []
    for ns in namespaces:
        try:
            cids = os.listdir(os.path.join(bed.task_dir, ns))
        except OSError:
            continue
        for cid in cids:
            try:
                with open(os.path.join(bed.task_dir, ns, cid, "address")) as f:
                    addr = f.read().strip()
                    if addr.startswith("unix://"):
                        socks.add(addr[len("unix://"):])
            except OSError:
                pass
            digest = hashlib.sha256(os.path.join(bed.socket, ns, cid).encode()).hexdigest()
            socks.add(os.path.join("/run/containerd/s", digest))
    return sorted(s for s in socks if under(s, "/run/containerd/s"))


def bed_sandbox_ids(bed: BedLayout) -> set[str]:
    """IDs of sandboxes and containers this bed knows of (for shared caches keyed by them)."""
    ids: set[str] = set()
    dirs = [os.path.join(bed.root, "io.containerd.grpc.v1.cri", "sandboxes")]
    try:
        dirs += [os.path.join(bed.task_dir, ns) for ns in os.listdir(bed.task_dir)]
    except OSError:
        pass
    for d in dirs:
        try:
            ids.update(e for e in os.listdir(d) if re.fullmatch(r"[0-9a-f]{64}", e))
        except OSError:
            pass
    mine = re.compile(re.escape(bed.cni_network) + r"-([0-9a-f]{64})-")
    try:
        for entry in os.listdir(CNI_RESULTS_DIR):
            m = mine.match(entry)
            if m:
                ids.add(m.group(1))
    except OSError:
        pass
    return ids


def remove_cni_results(bed: BedLayout, ids: set[str]) -> None:
    """Drops libcni's cached results of this bed: its own network's, and those of
    containerd's built-in loopback network for this bed's sandboxes."""
    pattern = re.compile(r"(?:%s|cni-loopback)-([0-9a-f]{64})-" % re.escape(bed.cni_network))
    try:
        entries = os.listdir(CNI_RESULTS_DIR)
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry)
        if m and m.group(1) in ids:
            try:
                os.unlink(os.path.join(CNI_RESULTS_DIR, entry))
            except OSError:
                pass


def stop_containerd(bed: BedLayout, graceful: bool) -> None:
    pid = containerd_pid(bed)
    if pid is None:
        return
    if graceful and os.path.exists(bed.socket):
        try:
            remove_all_tasks(bed)
        except TestbedError as exc:
            log(f"graceful removal failed: {exc}")
    log(f"stopping containerd {pid}")
    kill([pid], signal.SIGTERM)
    if wait_gone([pid], STOP_TIMEOUT_S):
        kill([pid], signal.SIGKILL)
        if wait_gone([pid], 5):
            raise TestbedError(f"containerd {pid} does not exit")


def remove_all_tasks(bed: BedLayout) -> None:
    """Removes tasks and containers through containerd. Paused tasks are resumed
    first: a frozen task cannot die, and `tasks rm --force` would wait for it."""
    deadline = time.monotonic() + 30

    def ctr(*args: str, ns: str | None) -> subprocess.CompletedProcess[bytes]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TestbedError("timed out removing tasks through containerd")
        return bed.ctr(*args, namespace=ns, timeout=min(left, 10), check=False)

    for ns in ctr("namespaces", "ls", "-q", ns=None).stdout.decode().split():
        tasks = [line.split() for line in ctr("tasks", "ls", ns=ns).stdout.decode().splitlines()[1:]]
        for cols in tasks:
            if len(cols) >= 3 and cols[2].upper() in ("PAUSED", "PAUSING"):
                ctr("tasks", "resume", cols[0], ns=ns)
        for cols in tasks:
            if cols:
                ctr("tasks", "rm", "--force", cols[0], ns=ns)
        for cid in ctr("containers", "ls", "-q", ns=ns).stdout.decode().split():
            ctr("containers", "rm", cid, ns=ns)


def clear_bed(bed: BedLayout, graceful: bool) -> None:
    """Removes everything this bed may have left behind: processes, runc state,
    mounts, network namespaces, the bridge, CNI results, cgroups and its dirs."""
    index = bed.recorded_index()
    tasks = shim_tasks(bed)
    resume_runc_containers(bed)
    stop_containerd(bed, graceful)
    delete_runc_containers(bed)
    procs = bed_processes(bed)
    if procs:
        log(f"killing leftover processes {sorted(procs)}")
        kill(list(procs), signal.SIGKILL)
        left = wait_gone(list(procs), 5)
        if left:
            raise TestbedError(f"processes {left} of bed {bed.name} do not exit")
    kill_cgroups(bed)
    sandbox_ids = bed_sandbox_ids(bed)
    sockets = shim_sockets(bed, tasks, sandbox_ids)
    unmount_under([bed.state, bed.base])
    for sock in sockets:
        try:
            os.unlink(sock)
        except OSError:
            pass
    if index is not None and link_exists(BedLayout.bridge(index)) and claimed_indexes(bed.name).get(index) is None:
        run(["ip", "link", "delete", BedLayout.bridge(index)], check=False)
    remove_cni_results(bed, sandbox_ids)
    remove_cgroups(bed)
    for path in (bed.state, bed.base):
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path):
            raise TestbedError(f"cannot remove {path}")
