"""Where a bed lives: its name, directories, sockets, index, network, images and lock.

`BedLayout` is one bed's layout on disk (under /var/lib/node-agent-testbed
and /run/node-agent-testbed) and the ctr and runc it goes with; `Lock` is the
flock that serialises commands on one bed (and on the shared index and image
cache). A bed's index picks its bridge and subnet. `write_hosts_toml` writes
a registry's hosts.toml into a registry hosts directory (a bed's `hosts_dir`,
or any other containerd ``config_path``).

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

from node_agent.containerd import all_runtimes
from testbed.host import CTR_TIMEOUT_S, TestbedError, run

BASE_ROOT = "/var/lib/node-agent-testbed"
STATE_ROOT = "/run/node-agent-testbed"
CACHE_DIR = "/var/cache/node-agent-testbed/images"
CNI_BIN_DIR = "/usr/lib/cni"
CNI_RESULTS_DIR = "/var/lib/cni/results"  # libcni's result cache, shared by everyone
SYSTEM_RUNC_ROOT = "/run/containerd/runc"  # used by `ctr run` without --runc-root
CGROUP_PARENT_ROOT = "/node-agent-testbed"
INDEX_MIN, INDEX_MAX = 1, 200
K8S_NAMESPACE = "k8s.io"
IMAGE_PREFIX = "localhost/node-agent-test"
IMAGES = {
    "busybox": f"{IMAGE_PREFIX}/busybox:1",
    "pause": f"{IMAGE_PREFIX}/pause:1",
    "memhog": f"{IMAGE_PREFIX}/memhog:1",
    "debian": f"{IMAGE_PREFIX}/debian:1",
    "torch": f"{IMAGE_PREFIX}/torch:1",
}
# Imported only when asked for (`scripts/testbed up --images ...`): the torch image
# costs minutes to build and 1.6 GiB to import.
OPTIONAL_IMAGES = ("torch",)
# Bump when the image layout changes, so cached tarballs are rebuilt.
IMAGE_FORMAT = "node-agent-testbed-image-4"
# The workloads' sources: scripts/testbed_images of this checkout.
IMAGE_SOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "testbed_images")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


class Lock:
    """An exclusive flock held for the life of the object's `with` block."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1

    def __enter__(self) -> "Lock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not unlinked by a holder before we got it
                self.fd = fd
                return self
            os.close(fd)

    def unlink(self) -> None:
        """Removes the lock file; only while holding it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        self.fd = -1


class BedLayout:
    """One bed's directories, sockets, network and cgroup names, and the ctr and runc it goes with."""

    def __init__(self, name: str):
        if not NAME_RE.match(name):
            raise TestbedError(f"invalid bed name {name!r}: use 1-40 of [a-z0-9-], starting alphanumeric")
        self.name = name
        self.base = os.path.join(BASE_ROOT, name)
        self.state = os.path.join(STATE_ROOT, name)
        self.root = os.path.join(self.base, "root")
        self.config = os.path.join(self.base, "config.toml")
        self.log = os.path.join(self.base, "containerd.log")
        self.json_path = os.path.join(self.base, "testbed.json")
        self.index_path = os.path.join(self.base, "index")
        self.cni_conf_dir = os.path.join(self.base, "cni", "net.d")
        self.ipam_dir = os.path.join(self.base, "cni", "ipam")
        self.opt_dir = os.path.join(self.base, "opt")
        self.pod_log_root = os.path.join(self.base, "pods")
        # Where the bed's pods keep their own volumes, as a kubelet's root dir
        # does (<kubelet_root>/pods/<uid>/volumes/...).
        self.kubelet_root = os.path.join(self.base, "kubelet")
        self.ctr_state = os.path.join(self.state, "containerd")
        self.socket = os.path.join(self.state, "containerd.sock")
        self.ttrpc_socket = self.socket + ".ttrpc"
        self.pid_path = os.path.join(self.state, "containerd.pid")
        self.runc_base = os.path.join(self.state, "runc")
        self.runc_root = os.path.join(self.runc_base, K8S_NAMESPACE)
        # netns_mounts_under_state_dir puts them in the CRI plugin's state dir.
        self.netns_dir = os.path.join(self.ctr_state, "io.containerd.grpc.v1.cri", "netns")
        self.task_dir = os.path.join(self.ctr_state, "io.containerd.runtime.v2.task")
        self.cni_network = f"node-agent-testbed-{name}"
        self.cgroup_parent = f"{CGROUP_PARENT_ROOT}/{name}"
        self.lock_path = os.path.join(STATE_ROOT, ".locks", f"{name}.lock")
        # NRI (containerd 2.x beds only): the bed's own socket and plugin dirs.
        self.nri_socket = os.path.join(self.state, "nri", "nri.sock")
        self.nri_plugin_dir = os.path.join(self.base, "nri", "plugins")
        self.nri_conf_dir = os.path.join(self.base, "nri", "conf.d")
        # CDI specs this bed's containerd reads, instead of the host's /etc/cdi and /var/run/cdi.
        self.cdi_dir = os.path.join(self.base, "cdi")
        # Registry host configs (<dir>/<host:port>/hosts.toml) for the CRI plugin's pulls.
        self.hosts_dir = os.path.join(self.base, "certs.d")
        # The ctr and runc this bed's containerd goes with (see load_tools).
        self.ctr_bin = "ctr"
        self.runc_bin = "runc"

    def load_tools(self) -> None:
        """Takes the ctr and runc of the bed's last `up` from its JSON (or, if
        that `up` never got so far, the runc runtime's BinaryName in its
        config), for cleaning up what that containerd left: runc 1.3 state with
        runc 1.3."""
        paths: dict[str, Any] = {}
        try:
            with open(self.json_path) as f:
                info = json.load(f)
            if isinstance(info, dict):
                paths = {"ctr_bin": info.get("ctr_binary"), "runc_bin": info.get("runc_binary")}
        except (OSError, ValueError):
            try:
                with open(self.config, "rb") as f:
                    runc = all_runtimes(tomllib.load(f)).get("runc")
                options = runc.get("options") if isinstance(runc, dict) else None
                paths = {"runc_bin": options.get("BinaryName") if isinstance(options, dict) else None}
            except (OSError, tomllib.TOMLDecodeError):
                pass
        for attr, path in paths.items():
            if isinstance(path, str) and os.path.isfile(path) and os.access(path, os.X_OK):
                setattr(self, attr, path)

    @staticmethod
    def bridge(index: int) -> str:
        return f"natb{index}"

    @staticmethod
    def subnet(index: int) -> str:
        return f"10.231.{index}.0/24"

    @staticmethod
    def gateway(index: int) -> str:
        return f"10.231.{index}.1"

    def recorded_index(self) -> int | None:
        try:
            with open(self.index_path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            pass
        try:
            with open(self.json_path) as f:
                return int(json.load(f)["index"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def ctr(self, *args: str, namespace: str | None = K8S_NAMESPACE, timeout: float = CTR_TIMEOUT_S,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        argv = [self.ctr_bin, "--address", self.socket]
        if namespace:
            argv += ["--namespace", namespace]
        return run(argv + list(args), timeout=timeout, check=check)


def write_hosts_toml(hosts_dir: str | os.PathLike[str], registry: str, text: str) -> Path:
    """Writes `text` as `<hosts_dir>/<registry>/hosts.toml`, making the directory if need be; returns its path.

    `registry` is the directory's name as containerd looks it up (`host:port`, `host_port_`, `_default`).
    """
    directory = Path(hosts_dir) / registry
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "hosts.toml"
    path.write_text(text, encoding="utf-8")
    return path


def claimed_indexes(exclude: str) -> dict[int, str]:
    """The indexes other beds (all but `exclude`) hold: index -> bed name."""
    claims: dict[int, str] = {}
    try:
        names = os.listdir(BASE_ROOT)
    except OSError:
        return claims
    for name in names:
        if name == exclude or not NAME_RE.match(name):
            continue
        idx = BedLayout(name).recorded_index()
        if idx is not None:
            claims[idx] = name
    return claims


def choose_index(bed: BedLayout, requested: int | None, previous: int | None) -> int:
    """The bed's index: `requested` (--index), else its `previous` one while free, else the lowest free one."""
    claims = claimed_indexes(bed.name)
    if requested is not None:
        if not INDEX_MIN <= requested <= INDEX_MAX:
            raise TestbedError(f"--index must be in {INDEX_MIN}..{INDEX_MAX}")
        if requested in claims:
            raise TestbedError(f"index {requested} is used by bed {claims[requested]}")
        return requested
    if previous is not None and INDEX_MIN <= previous <= INDEX_MAX and previous not in claims:
        return previous
    for idx in range(INDEX_MIN, INDEX_MAX + 1):
        if idx not in claims:
            return idx
    raise TestbedError(f"no free index in {INDEX_MIN}..{INDEX_MAX}")
