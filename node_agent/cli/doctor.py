"""`node-agent doctor`: can this node checkpoint and restore pods?

One line per check: OK, WARN or FAIL, with what to do about anything that
isn't OK. Exits 0 when nothing FAILs. Works without a running daemon.

`--deployment` adds what a systemd unit or a DaemonSet pod must provide: the
host's sockets and paths mounted at the same place, privileges that are not
filtered away, CRIU's optional features, the restore handler registered in
containerd's config (and loaded) with its wrapper runnable on the host, API
credentials for device taints, and NVML on nodes with NVIDIA GPUs. Host paths
are looked up under `--host-root` (a pod mounts the host's `/` there).
Reads files and runs `criu`; never changes anything.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import dataclasses
import os
import shutil
import stat
import sys
from typing import Any, Callable

from criu_bridge.mountinfo import Mount
from node_agent import policy
from node_agent.cli.checks import (CAP_CHECKPOINT_RESTORE, CAP_DAC_OVERRIDE, CAP_NET_ADMIN, CAP_SYS_ADMIN,
                                   CAP_SYS_PTRACE, MIN_CRIU, Check, criu_cache_check, effective_caps, in_container,
                                   mount_of, mounts, pids_of, status_field, version_line)
from node_agent.config.schema import Settings


async def _criu_checks(s: Settings) -> tuple[list[Check], dict[str, bool] | None]:
    """CRIU's checks, and its feature report (None where it gave none)."""
    from criu_bridge.errors import BridgeError
    from criu_bridge.rpc import CriuClient

    path = s.criu if os.path.isabs(s.criu) else shutil.which(s.criu)
    if not path:
        return [Check("criu", "FAIL", f"{s.criu} not found on PATH; install CRIU >= 4.2 (scripts/install-host)")], None
    client = CriuClient(path, timeout=30)
    out = []
    try:
        v = await client.version()
    except BridgeError as exc:
        return [Check("criu", "FAIL", f"{path} does not answer: {exc}")], None
    if (v.major, v.minor) < MIN_CRIU:
        out.append(Check("criu", "FAIL", f"{path} is {v.text}; 4.2 or newer is needed (4.1 cannot dump TCP sockets on current kernels)"))
    else:
        out.append(Check("criu", "OK", f"{path} {v.text}"))
    try:
        await client.check()
        out.append(Check("criu check", "OK", "the kernel supports what CRIU needs"))
    except BridgeError as exc:
        out.append(Check("criu check", "FAIL", f"{exc}"))
    try:
        feats = await client.features()
    except BridgeError as exc:
        out.append(Check("criu features", "WARN", f"cannot query: {exc}"))
        return out, None
    out.append(
        Check("mem_dirty_track", "OK", "iterative pre-dump available")
        if feats.get("mem_track")
        else Check("mem_dirty_track", "WARN", "no soft-dirty memory tracking (CONFIG_MEM_SOFT_DIRTY off): checkpoints freeze the pod for a full dump")
    )
    return out, feats


def _lazy_check(s: Settings, features: dict[str, bool] | None = None) -> Check:
    """The node's one lazy-restore verdict (`lazy.support`), with CRIU's feature report folded in."""
    from node_agent.lazy.support import lazy_restore_support

    ok, why = lazy_restore_support(s.criu, reported=None if features is None else features.get("lazy_pages", False))
    if ok:
        return Check("lazy restore", "OK", "available (criu check --feature uffd-noncoop)")
    fix = ("install CRIU >= 4.2" if why.startswith("no ") else
           "a kernel with userfaultfd (CONFIG_USERFAULTFD) and vm.unprivileged_userfaultfd or CAP_SYS_PTRACE")
    return Check("lazy restore", "WARN", f"unavailable (falls back to full restore): {why}", fix)


def _cri_check(s: Settings) -> Check:
    async def probe() -> tuple[str, str]:
        from node_agent.cri import CriClient

        c = CriClient(s.cri_endpoint, timeout=5)
        try:
            return await c.version()
        finally:
            await c.close()

    try:
        name, ver = asyncio.run(probe())
        if name == "containerd" and ver.lstrip("v").startswith("1.6"):
            return Check("cri", "WARN", f"{s.cri_endpoint}: {name} {ver}: untested (containerd 1.6 reached its end "
                                        "of life in 2025; node-agent is tested on 2.1 and 1.7)",
                         "upgrade containerd to 2.x")
        return Check("cri", "OK", f"{s.cri_endpoint}: {name} {ver}")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check("cri", "WARN", f"{s.cri_endpoint} not reachable ({str(exc).splitlines()[0][:160]}); start containerd or pass --cri-endpoint")


def _handler_check(s: Settings) -> Check:
    """Whether containerd's restore handler serves this agent's plans (as `serve` checks before a restore)."""

    async def probe() -> list[str]:
        from node_agent import runtime_handler
        from node_agent.cri import CriClient

        c = CriClient(s.cri_endpoint, timeout=5)
        try:
            return (await runtime_handler.inspect(c, s.runtime_handler)).problems(s)
        finally:
            await c.close()

    from node_agent import errors
    from node_agent.runtime_handler import fix_command

    try:
        problems = asyncio.run(probe())
    except errors.FailedPrecondition as exc:
        return Check("restore handler", "FAIL", str(exc), "run the agent on containerd 1.6 or newer")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check("restore handler", "WARN", f"not checked: no CRI at {s.cri_endpoint} "
                                                f"({str(exc).splitlines()[0][:120]})")
    if problems:
        return Check("restore handler", "FAIL", "; ".join(problems) + ": restores are refused", fix_command(s))
    return Check("restore handler", "OK", f"{s.runtime_handler!r} runs this agent's wrapper for {s.plans_dir}")


def run_checks(s: Settings) -> list[Check]:
    checks: list[Check] = []
    caps = effective_caps()
    if os.geteuid() != 0:
        checks.append(Check("privileges", "FAIL", "not root: checkpoint and restore need root"))
    elif not caps & (1 << CAP_SYS_ADMIN):
        checks.append(Check("privileges", "FAIL", "CAP_SYS_ADMIN missing: run privileged"))
    else:
        extra = "" if caps & (1 << CAP_CHECKPOINT_RESTORE) else " (CAP_CHECKPOINT_RESTORE missing; CAP_SYS_ADMIN covers it)"
        checks.append(Check("privileges", "OK", "root with CAP_SYS_ADMIN" + extra))

    runc = s.runc if os.path.isabs(s.runc) else shutil.which(s.runc)
    if runc:
        checks.append(Check("runc", "OK", f"{runc}: {version_line([runc, '--version']) or '?'}"))
    else:
        checks.append(Check("runc", "FAIL", f"{s.runc} not found on PATH; install runc"))

    criu, features = asyncio.run(_criu_checks(s))
    checks.extend(criu)
    checks.append(_lazy_check(s, features))

    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        checks.append(Check("cgroups", "OK", "v2 (unified)"))
    elif os.path.isdir("/sys/fs/cgroup/freezer"):
        checks.append(Check("cgroups", "OK", "v1 with the freezer controller"))
    else:
        checks.append(Check("cgroups", "FAIL", "no cgroup freezer found: pods cannot be paused"))

    checks.append(criu_cache_check(mounts()))

    if shutil.which("iptables-restore") or shutil.which("nft"):
        checks.append(Check("network lock", "OK", "iptables-restore/nft present for CRIU's network lock"))
    else:
        checks.append(Check("network lock", "FAIL", "neither iptables-restore nor nft found: CRIU cannot lock the network; install iptables"))

    checks.append(_cri_check(s))
    checks.append(_handler_check(s))

    if os.path.isdir(s.store):
        mode = os.stat(s.store).st_mode & 0o777
        st = os.statvfs(s.store)
        free = st.f_bavail * st.f_frsize
        if mode & 0o077:
            checks.append(Check("store", "WARN", f"{s.store} is mode {mode:o}; `serve` tightens it to 700"))
        else:
            checks.append(Check("store", "OK", f"{s.store}: {free >> 30} GiB free"))
    else:
        checks.append(Check("store", "WARN", f"{s.store} does not exist yet; `serve` creates it (mode 700)"))

    if os.path.exists(s.socket):
        checks.append(Check("daemon", "OK", f"socket {s.socket} present"))
    else:
        checks.append(Check("daemon", "WARN", f"no daemon socket at {s.socket}; run `node-agent serve`"))

    if ctypes.util.find_library("nvidia-ml"):
        checks.append(Check("nvml", "OK", "libnvidia-ml found"))
    else:
        checks.append(Check("nvml", "WARN", "libnvidia-ml not found: NVIDIA GPUs, if any, are reported as unmonitored"))
    return checks


# ---- --deployment ----------------------------------------------------------------

CONTAINERD_CONFIG = "/etc/containerd/config.toml"
NVIDIA_VENDOR = "0x10de"
_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def _host(host_root: str, path: str) -> str:
    return path if host_root in ("", "/") else os.path.join(host_root, path.lstrip("/"))


def _mount_checks(s: Settings, table: list[Mount], contained: bool) -> list[Check]:
    out: list[Check] = []
    mount_fix = "mount the host's {p} at {p} (hostPath) in the agent's container"

    def from_host(path: str) -> bool:
        if not contained:
            return True
        m = mount_of(path, table)
        return m is not None and m.point != "/"

    sock = s.cri_endpoint.removeprefix("unix://").removeprefix("unix:")
    if s.cri_endpoint.startswith("unix"):
        if os.path.exists(sock) and stat.S_ISSOCK(os.stat(sock).st_mode):
            out.append(Check("mount cri socket", "OK", sock))
        else:
            out.append(Check("mount cri socket", "FAIL", f"no socket at {sock}",
                             mount_fix.format(p=os.path.dirname(sock)) if contained else "start containerd, or pass --cri-endpoint"))
    runc_parent = os.path.dirname(s.runc_root.rstrip("/"))
    if os.path.isdir(s.runc_root) and from_host(s.runc_root):
        out.append(Check("mount runc root", "OK", s.runc_root))
    elif os.path.isdir(runc_parent) and from_host(runc_parent):
        out.append(Check("mount runc root", "WARN", f"{s.runc_root} does not exist yet (runc creates it with the first container)",
                         "none needed if containerd has run no container yet; else check runc-root"))
    else:
        out.append(Check("mount runc root", "FAIL", f"{runc_parent} is not the host's runc state",
                         mount_fix.format(p=runc_parent) if contained else "check runc-root against containerd's runc options Root"))
    if not os.path.isdir(s.store):
        out.append(Check("mount store", "FAIL" if contained else "WARN", f"{s.store} does not exist",
                         mount_fix.format(p=s.store) if contained else "`node-agent serve` creates it"))
    elif not from_host(s.store):
        out.append(Check("mount store", "FAIL", f"{s.store} lies in the container's own filesystem: checkpoints and restore plans "
                         "would not reach the host's wrapper", mount_fix.format(p=s.store)))
    else:
        out.append(Check("mount store", "OK", s.store))
    cg = mount_of("/sys/fs/cgroup", table)
    if cg is not None and cg.fstype in ("cgroup2", "tmpfs", "cgroup"):
        out.append(Check("mount /sys", "OK", f"/sys/fs/cgroup ({'v2' if cg.fstype == 'cgroup2' else 'v1'})"))
    else:
        out.append(Check("mount /sys", "FAIL", "no cgroup hierarchy at /sys/fs/cgroup", mount_fix.format(p="/sys")))
    dev = mount_of("/dev", table)
    if not contained or (dev is not None and dev.fstype == "devtmpfs"):
        out.append(Check("mount /dev", "OK", "the host's /dev"))
    else:
        out.append(Check("mount /dev", "WARN", "the container's own /dev: devices added later (GPUs, disks) are not seen",
                         mount_fix.format(p="/dev")))
    if pids_of("containerd"):
        out.append(Check("host pids", "OK", "the host's processes are visible (containerd found in /proc)"))
    else:
        out.append(Check("host pids", "FAIL", "no containerd process in /proc: the containers' processes cannot be frozen or dumped",
                         "run in the host's PID namespace (hostPID: true; podman --pid=host)"))
    return out


def _privilege_checks() -> list[Check]:
    out: list[Check] = []
    caps = effective_caps()
    missing = [n for n, b in (("CAP_SYS_ADMIN", CAP_SYS_ADMIN), ("CAP_SYS_PTRACE", CAP_SYS_PTRACE),
                              ("CAP_DAC_OVERRIDE", CAP_DAC_OVERRIDE), ("CAP_NET_ADMIN", CAP_NET_ADMIN)) if not caps & (1 << b)]
    if missing:
        out.append(Check("capabilities", "FAIL", f"missing {', '.join(missing)}",
                         "run privileged (securityContext.privileged: true), or as root without a capability bounding set"))
    else:
        out.append(Check("capabilities", "OK", "CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_DAC_OVERRIDE, CAP_NET_ADMIN"))
    seccomp = status_field("Seccomp")
    if seccomp in ("", "0"):
        out.append(Check("seccomp", "OK", "no seccomp filter"))
    else:
        out.append(Check("seccomp", "FAIL", f"a seccomp filter is active (mode {seccomp}): CRIU's ptrace and parasite calls are blocked",
                         "run privileged, or seccompProfile: Unconfined"))
    if status_field("NoNewPrivs") not in ("", "0"):
        out.append(Check("no_new_privs", "WARN", "no_new_privs is set: runc and CRIU inherit it",
                         "drop NoNewPrivileges / allowPrivilegeEscalation: false"))
    try:
        with open("/proc/self/attr/current", encoding="utf-8") as fh:
            label = fh.read().strip("\0\n ")
    except OSError:
        label = ""
    if label and label != "unconfined" and not label.startswith("unconfined"):
        out.append(Check("lsm", "WARN", f"confined by {label!r}: ptrace and mounts may be refused",
                         "run privileged (AppArmor/SELinux unconfined)"))
    return out


def _start_time(pid: int) -> float | None:
    """When a process started (seconds since the epoch)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _containerd_loaded(config_host_path: str, config_mtime: float) -> Check | None:
    """FAIL when every containerd using this config started before it last changed."""
    starts = []
    for pid in pids_of("containerd"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            continue
        given = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")), None)
        given = given or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
        if (given or CONTAINERD_CONFIG) == config_host_path:
            started = _start_time(pid)
            if started is not None:
                starts.append(started)
    if not starts:
        return None
    if max(starts) + 1 < config_mtime:
        return Check("handler loaded", "FAIL", f"containerd started before {config_host_path} last changed: the handler is not loaded",
                     "restart containerd (systemctl restart containerd)")
    return Check("handler loaded", "OK", "containerd started after its config last changed")


def _interpreter(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    return parts[0] if parts else None


def _wrapper_runc(path: str) -> str | None:
    """The runc a launcher written by criu_bridge.wrapper.install runs."""
    from criu_bridge.wrapper import launcher_settings

    found = launcher_settings(path)
    return found[0] if found else None


def _handler_checks(s: Settings, config_path: str, host_root: str) -> list[Check]:
    import tomllib

    where = _host(host_root, config_path)
    fix = "run `node-agent install-handler` (DaemonSet: its init container) or append `node-agent containerd-config`, then restart containerd"
    from node_agent import containerd
    from node_agent.errors import AgentError

    try:
        with open(where, "rb") as fh:
            doc = tomllib.load(fh)
        version = containerd.version_of(doc, config_path)
    except FileNotFoundError:
        return [Check("handler", "FAIL", f"no containerd config at {config_path}", fix)]
    except (OSError, tomllib.TOMLDecodeError, AgentError) as exc:
        return [Check("handler", "FAIL", f"cannot read {config_path}: {exc}", "fix containerd's config")]
    rt = containerd.runtimes(doc, version).get(s.runtime_handler)
    if not isinstance(rt, dict):
        other = 3 if version == 2 else 2
        hint = (f" (its tables are written for version {other}, which this version-{version} file ignores)"
                if isinstance(containerd.runtimes(doc, other).get(s.runtime_handler), dict) else "")
        return [Check("handler", "FAIL", f"runtime handler {s.runtime_handler!r} is not in {config_path}{hint}",
                      fix.replace("`node-agent containerd-config`",
                                  f"`node-agent containerd-config --containerd-config {config_path}`"))]
    out: list[Check] = []
    if version == 3 and rt.get("sandboxer", containerd.SANDBOXER) != containerd.SANDBOXER:
        out.append(Check("handler sandboxer", "FAIL",
                         f"{s.runtime_handler!r} has sandboxer = {rt.get('sandboxer')!r}; a restore needs "
                         f"{containerd.SANDBOXER!r} (a pause-container sandbox)",
                         f'set sandboxer = "{containerd.SANDBOXER}" in its table'))
    opts = rt.get("options", {})
    binary = str(opts.get("BinaryName", ""))
    root = str(opts.get("Root", ""))
    expect_root = os.path.dirname(s.runc_root.rstrip("/"))
    if root and os.path.normpath(root) != os.path.normpath(expect_root):
        out.append(Check("handler", "FAIL", f"{s.runtime_handler!r} has Root {root}, but runc-root is {s.runc_root}",
                         f"set Root = \"{expect_root}\" (or runc-root) so both agree"))
    else:
        out.append(Check("handler", "OK", f"{s.runtime_handler!r} in {config_path}"))
    host_binary = _host(host_root, binary) if binary else ""
    if not binary:
        out.append(Check("wrapper", "FAIL", f"{s.runtime_handler!r} has no options.BinaryName", fix))
    elif not os.access(host_binary, os.X_OK):
        out.append(Check("wrapper", "FAIL", f"{binary} is missing or not executable on the host", fix))
    else:
        interp = _interpreter(host_binary)
        runc = _wrapper_runc(host_binary)
        if interp and not os.access(_host(host_root, interp), os.X_OK):
            out.append(Check("wrapper", "FAIL", f"{binary} runs on {interp}, which the host lacks",
                             "run `node-agent install-handler --runtime-bundle /opt/node-agent/runtime` (the image's init container does)"))
        elif runc and not os.access(_host(host_root, runc), os.X_OK):
            out.append(Check("wrapper", "FAIL", f"{binary} runs {runc}, which the host lacks",
                             "run `node-agent install-handler --runc PATH` with the host's runc"))
        else:
            out.append(Check("wrapper", "OK", f"{binary} executable on the host" + (f" (on {interp})" if interp else "")))
    try:
        loaded = _containerd_loaded(config_path, os.stat(where).st_mtime)
    except OSError:
        loaded = None
    if loaded is not None:
        out.append(loaded)
    return out


def _credentials_check(kubeconfig: str = "", needed: bool = True) -> Check:
    if not needed:
        return Check("api credentials", "OK", "not needed: device taints are off (devices.enabled / devices.taints)")
    if kubeconfig:
        if os.path.isfile(kubeconfig):
            return Check("api credentials", "OK", f"kubeconfig {kubeconfig} (devices.kubeconfig)")
        return Check("api credentials", "WARN", f"devices.kubeconfig {kubeconfig} does not exist: device taints cannot be published",
                     "mount the kubeconfig there, or remove devices.kubeconfig to use the in-cluster service account")
    token = os.path.join(_SA_DIR, "token")
    if os.path.exists(token) and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return Check("api credentials", "OK", f"in-cluster service account ({_SA_DIR})")
    kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    for path in kubeconfig.split(":"):
        if path and os.path.isfile(path):
            return Check("api credentials", "OK", f"kubeconfig {path}")
    return Check("api credentials", "WARN",
                 "no in-cluster service account and no kubeconfig: device taints cannot be published (checkpoint and restore need none)",
                 "run with the node-agent ServiceAccount (deploy/), or set KUBECONFIG")


def nvidia_gpus(sysfs: str = "/sys") -> list[str]:
    """PCI addresses of NVIDIA devices (vendor 0x10de) of display/3D class."""
    base = os.path.join(sysfs, "bus", "pci", "devices")
    found = []
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    for bdf in entries:
        try:
            with open(os.path.join(base, bdf, "vendor"), encoding="ascii") as fh:
                vendor = fh.read().strip().lower()
            with open(os.path.join(base, bdf, "class"), encoding="ascii") as fh:
                klass = fh.read().strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and klass.startswith("0x03"):
            found.append(bdf)
    return found


def _nvml_init() -> str | None:
    """None when NVML loads and initialises; else why not."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        return f"libnvidia-ml.so.1 does not load ({exc})"
    rc = int(lib.nvmlInit_v2())
    if rc != 0:
        return f"nvmlInit_v2 failed with NVML error {rc}"
    lib.nvmlShutdown()
    return None


def _nvml_check(sysfs: str = "/sys", init: Callable[[], str | None] = _nvml_init) -> Check:
    gpus = nvidia_gpus(sysfs)
    if not gpus:
        return Check("nvml gpus", "OK", "no NVIDIA GPU (PCI vendor 0x10de) on this node")
    problem = init()
    if problem:
        return Check("nvml gpus", "FAIL", f"{len(gpus)} NVIDIA GPU(s) ({', '.join(gpus[:4])}) but {problem}: they cannot be monitored",
                     "install the NVIDIA driver on the node and make libnvidia-ml.so.1 visible to the agent "
                     "(NVIDIA container toolkit, or mount the driver's library directory)")
    return Check("nvml gpus", "OK", f"NVML answers for {len(gpus)} NVIDIA GPU(s)")


def _policy_check(s: Settings) -> Check:
    """The policy's one check; its settings are printed after the checks (`policy_report`)."""
    r = s.restore
    if r.require_signature and not any(r.trusted_keys.values()):
        return Check("policy", "WARN", "restore.require-signature is true but restore.trusted-keys names no key: "
                     "every restore is refused", "list the signers' public keys under restore.trusted-keys")
    rules = len([ns for ns in s.namespaces if ns != policy.DEFAULT])
    return Check("policy", "OK", f"{rules} namespace rule(s) besides \"*\"; restores "
                 + ("need a trusted signature" if r.require_signature else "need no signature") + " (below)")


def policy_report(s: Settings) -> list[str]:
    """The effective checkpoint and restore policy, headed by where it was read from."""
    source = s.config_file or "the built-in defaults (no --config given)"
    return [f"policy, from {source}:"] + ["  " + line for line in policy.describe(s)]


def deployment_checks(s: Settings, base: list[Check], *, containerd_config: str = CONTAINERD_CONFIG,
                      host_root: str = "/") -> list[Check]:
    """`base` (run_checks) and the installation's checks; a CRI that does not answer FAILs here."""
    table = mounts()
    contained = in_container(table)
    # The installation's own checks below replace these, more precisely.
    replaced = {"store", "nvml"}
    out = [dataclasses.replace(c, verdict="FAIL") if c.name == "cri" and c.verdict == "WARN" else c
           for c in base if c.name not in replaced]
    out.append(Check("environment", "OK", "a container" if contained else "the host"))
    out.extend(_mount_checks(s, table, contained))
    out.extend(_privilege_checks())
    out.extend(_handler_checks(s, containerd_config, host_root))
    out.append(_credentials_check(s.devices.kubeconfig, s.devices.enabled and s.devices.taints))
    out.append(_nvml_check())
    out.append(_policy_check(s))
    return out


def add_parser(sub: Any, parent: argparse.ArgumentParser, settings_from: Callable[[argparse.Namespace], Settings]) -> None:
    p = sub.add_parser("doctor", parents=[parent], help="check this node for checkpoint/restore")
    p.add_argument("--deployment", action="store_true",
                   help="also check the installation: mounts, privileges, CRIU features, the containerd handler, "
                        "API credentials, NVML")
    p.add_argument("--containerd-config", metavar="FILE", default=CONTAINERD_CONFIG,
                   help=f"containerd's config, a host path (default {CONTAINERD_CONFIG}; --deployment)")
    p.add_argument("--host-root", metavar="DIR", default="/",
                   help="where the host's / is visible (the DaemonSet mounts it at /host; --deployment)")

    def run(args: argparse.Namespace) -> int:
        s = settings_from(args)
        checks = run_checks(s)
        if args.deployment:
            checks = deployment_checks(s, checks, containerd_config=args.containerd_config, host_root=args.host_root)
        for c in checks:
            sys.stdout.write(c.line() + "\n")
        if args.deployment:
            sys.stdout.write("".join(line + "\n" for line in policy_report(s)))
        return 1 if any(c.verdict == "FAIL" for c in checks) else 0

    p.set_defaults(func=run)
