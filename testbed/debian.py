"""The images built from Debian's packages: apt sources, debootstrap, the images' layers.

The Debian image holds every real workload: a debootstrap minbase of the
host's release from the mirror its apt sources name (deb822 .sources and
one-line .list files), stripped and cached as a layer of its own; a small
layer of workload programs and files (from scripts/testbed_images) with
nginx's generated content; and the model server's weights
(testbed/weights.py). The torch image is built the same way from Debian's
PyTorch and OpenBLAS, with the torch server and its own weights.

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from typing import Any

from testbed.host import PATH_ENV, TestbedError, log, run, tail, unmount_under, write_file
from testbed.layout import CACHE_DIR, IMAGE_FORMAT, IMAGE_SOURCES, IMAGES
from testbed.oci import Layer, oci_archive_file
from testbed.weights import MODEL_COLS, MODEL_PATH, MODEL_SEED, seeded_stream, weights_layer

# The Debian image, which holds every real workload (each pod picks its command):
# a debootstrap minbase of the host's release with Debian's own packages (its
# layer is cached on its own as debootstrap-SUITE-ARCH-KEY.tar), a small layer of
# workload programs and files, and a layer with the model server's weights.
DEBIAN_PACKAGES = ("python3", "sqlite3", "procps", "python3-numpy", "redis-server", "redis-tools", "nginx")
# Source file in IMAGE_SOURCES -> path in the image: programs (mode 0755), then files (0644).
DEBIAN_PROGRAMS = {
    "lockserver.py": "usr/local/bin/lockserver",
    "mpserver.py": "usr/local/bin/mpserver",
    "modelserver.py": "usr/local/bin/modelserver",
}
DEBIAN_FILES = {"nginx.conf": "etc/nginx/nginx.conf"}
DEBIAN_CMD = ["/usr/local/bin/lockserver"]
# nginx's static content, generated: /srv/www/index.html and a blob of seeded bytes.
NGINX_ROOT = "srv/www"
NGINX_BLOB_KIB = 1024
NGINX_SEED = b"node-agent-testbed-nginx-1"
# Removed from the rootfs before it becomes a layer (globs; the dirs stay).
DEBIAN_STRIP = (
    "usr/share/doc/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*",
    "usr/share/lintian/*", "var/lib/apt/lists/*", "var/cache/apt/*.bin",
    "var/cache/apt/archives/*.deb", "var/cache/debconf/*-old", "var/lib/dpkg/*-old",
    "var/log/*.log", "var/log/apt/*",
    "etc/hostname", "etc/resolv.conf",  # the host's, copied by debootstrap; CRI mounts its own
)
# The torch image (not imported by default: `scripts/testbed up --images ...,torch`): a
# debootstrap minbase of its own with Debian's PyTorch and OpenBLAS (cached as
# torchroot-SUITE-ARCH-KEY.tar), the torch server, and TORCH_MIB of seeded weights
# (128 layers of 1024 x 1024 float32) saved as .npy when the image is built.
TORCH_PACKAGES = ("python3", "python3-torch", "python3-numpy", "libopenblas0-pthread", "procps")
TORCH_PROGRAMS = {"torchserver.py": "usr/local/bin/torchserver"}
TORCH_CMD = ["/usr/local/bin/torchserver"]
TORCH_WEIGHTS = "opt/torchmodel/weights.npy"
TORCH_SEED = b"node-agent-testbed-torch-1"
TORCH_MIB = 512
DEBIAN_MIRROR_ENV = "NODE_AGENT_DEBIAN_MIRROR"
DEBOOTSTRAP_TIMEOUT_S = 1200.0
APT_SOURCES_LIST = "/etc/apt/sources.list"
APT_SOURCES_DIR = "/etc/apt/sources.list.d"
OS_RELEASE = "/etc/os-release"


def host_suite() -> str:
    """The host's Debian codename (VERSION_CODENAME in /etc/os-release)."""
    try:
        with open(OS_RELEASE) as f:
            for line in f:
                key, _, value = line.strip().partition("=")
                if key == "VERSION_CODENAME" and value.strip("\"'"):
                    return value.strip("\"'")
    except OSError as exc:
        raise TestbedError(f"cannot read {OS_RELEASE}: {exc.strerror}") from exc
    raise TestbedError(f"no VERSION_CODENAME in {OS_RELEASE}")


def dpkg_arch() -> str:
    return str(run(["dpkg", "--print-architecture"]).stdout.decode().strip())


def _deb822_entries(text: str) -> list[dict[str, str]]:
    """The stanzas of a deb822 .sources file, field names lower-cased."""
    stanzas: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    last: str | None = None
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if cur:
                stanzas.append(cur)
            cur, last = {}, None
        elif line[0] in " \t":
            if last:  # continuation of a multi-line field (Signed-By with a key)
                cur[last] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            last = key.strip().lower()
            cur[last] = value.strip()
    return stanzas


def _one_line_entries(text: str) -> list[dict[str, str]]:
    """The entries of a classic sources.list, as deb822-like dicts."""
    entries = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        kind, rest = words[0], words[1:]
        if rest and rest[0].startswith("["):  # [ arch=amd64 signed-by=... ]
            while rest and not rest[0].endswith("]"):
                rest = rest[1:]
            rest = rest[1:]
        if len(rest) >= 2:
            entries.append({"types": kind, "uris": rest[0], "suites": rest[1],
                            "components": " ".join(rest[2:])})
    return entries


def apt_source_entries() -> list[dict[str, str]]:
    """The system's apt sources in apt's order: sources.list, then sources.list.d/*."""
    files = [APT_SOURCES_LIST]
    try:
        files += [os.path.join(APT_SOURCES_DIR, n) for n in sorted(os.listdir(APT_SOURCES_DIR))
                  if n.endswith((".list", ".sources"))]
    except OSError:
        pass
    entries: list[dict[str, str]] = []
    for path in files:
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        entries += _deb822_entries(text) if path.endswith(".sources") else _one_line_entries(text)
    return entries


def debian_mirror(suite: str) -> str:
    """The mirror debootstrap uses: $NODE_AGENT_DEBIAN_MIRROR, else the first `deb`
    URI of the system's apt sources that serves `suite` itself (not -security)."""
    override = os.environ.get(DEBIAN_MIRROR_ENV, "").strip()
    if override:
        return override.rstrip("/")
    for entry in apt_source_entries():
        if entry.get("enabled", "yes").lower() in ("no", "false", "0"):
            continue
        if "deb" not in entry.get("types", "").split() or suite not in entry.get("suites", "").split():
            continue
        for uri in entry.get("uris", "").split():
            if re.match(r"^(https?|ftp|file):", uri):
                return uri.rstrip("/")
    raise TestbedError(f"no 'deb' source for suite {suite} in {APT_SOURCES_LIST} or {APT_SOURCES_DIR}/*.sources; "
                       f"set {DEBIAN_MIRROR_ENV} to a Debian mirror URL")


def strip_rootfs(root: str) -> None:
    for pattern in DEBIAN_STRIP:
        for path in glob.glob(os.path.join(root, pattern)):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)


def rootfs_layer(root: str, out: str) -> tuple[int, int]:
    """Writes the tree at `root` as an uncompressed layer tar to `out` (atomically):
    numeric owners, modes and hard links kept, device nodes, fifos and sockets left
    out, and nothing under /dev (a container's /dev comes from the runtime).
    Returns (entries, bytes)."""
    tmp = f"{out}.tmp.{os.getpid()}"
    count = 0
    try:
        with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
            def walk(rel: str) -> None:
                nonlocal count
                for name in sorted(os.listdir(os.path.join(root, rel))):
                    path = f"{rel}/{name}" if rel else name
                    if path.startswith("dev/"):
                        continue
                    full = os.path.join(root, path)
                    st = os.lstat(full)
                    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                        continue
                    info = tar.gettarinfo(full, arcname=path)
                    info.uname = info.gname = ""
                    info.mtime = int(info.mtime)
                    if info.isreg():
                        with open(full, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
                    count += 1
                    if stat.S_ISDIR(st.st_mode):
                        walk(path)

            walk("")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return count, os.path.getsize(out)


def remove_rootfs(root: str) -> None:
    """Removes a debootstrap target, after unmounting whatever debootstrap left
    mounted in it (/proc, /sys, /dev binds of the host's device nodes)."""
    unmount_under([root])
    shutil.rmtree(root, ignore_errors=True)


def debootstrap_layer(suite: str, arch: str, mirror: str, out: str, packages: tuple[str, ...] = DEBIAN_PACKAGES) -> None:
    """Runs debootstrap (minbase and `packages`) into a scratch dir of the cache and writes
    its rootfs as a layer."""
    binary = shutil.which("debootstrap", path=PATH_ENV)
    if binary is None:
        raise TestbedError("debootstrap not found (run scripts/install-host)")
    root = tempfile.mkdtemp(prefix="rootfs.", dir=CACHE_DIR)
    logpath = os.path.join(CACHE_DIR, "debootstrap.log")
    argv = [binary, "--variant=minbase", f"--include={','.join(packages)}", suite, root, mirror]
    env = {"PATH": PATH_ENV, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
    for key in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        if key in os.environ:
            env[key] = os.environ[key]
    try:
        log(f"debootstrap {suite} ({arch}) from {mirror} into {root} (log {logpath})")
        t0 = time.monotonic()
        with open(logpath, "wb") as logf:
            try:
                proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                      env=env, timeout=DEBOOTSTRAP_TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired as exc:
                raise TestbedError(f"debootstrap timed out after {DEBOOTSTRAP_TIMEOUT_S:.0f}s; log {logpath}: "
                                   f"{tail(logpath)}") from exc
        if proc.returncode != 0:
            raise TestbedError(f"debootstrap failed ({proc.returncode}); log {logpath}: {tail(logpath)}")
        log(f"debootstrap done in {time.monotonic() - t0:.0f}s")
        unmount_under([root])  # normally nothing: debootstrap unmounts on exit
        strip_rootfs(root)
        entries, size = rootfs_layer(root, out)
        log(f"wrote layer {out} ({entries} entries, {size / 2**20:.1f} MiB)")
    finally:
        remove_rootfs(root)


def debian_program_layer(programs: dict[str, bytes], files: dict[str, bytes], nginx: bool = True) -> bytes:
    """The workload layer of a Debian image: each program (mode 0755), each file (0644)
    and (`nginx`) nginx's static content."""
    layer = Layer()
    for path, data in programs.items():
        layer.file(path, data, 0o755)
    for path, data in files.items():
        layer.file(path, data, 0o644)
    if nginx:
        layer.file(f"{NGINX_ROOT}/index.html", b"<html><body>node-agent test bed nginx</body></html>\n")
        layer.file(f"{NGINX_ROOT}/blob.bin", b"".join(seeded_stream(NGINX_SEED, NGINX_BLOB_KIB << 10)))
    return layer.finish()


def _read_sources(names: dict[str, str]) -> dict[str, bytes]:
    out = {}
    for src, dest in names.items():
        path = os.path.join(IMAGE_SOURCES, src)
        try:
            with open(path, "rb") as f:
                out[dest] = f.read()
        except OSError as exc:
            raise TestbedError(f"cannot read {path}: {exc.strerror}") from exc
    return out


def _root_key(suite: str, arch: str, mirror: str, packages: tuple[str, ...]) -> str:
    """What a cached debootstrap layer is built from."""
    h = hashlib.sha256()
    for part in (IMAGE_FORMAT, suite, arch, ",".join(packages), mirror, "\n".join(DEBIAN_STRIP)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:20]


def _hash_sources(h: Any, sources: dict[str, dict[str, bytes]]) -> None:
    for kind, contents in sources.items():
        for dest in sorted(contents):
            h.update(f"{kind}:{dest}".encode() + b"\0" + hashlib.sha256(contents[dest]).hexdigest().encode() + b"\0")


def debian_inputs(mib: int) -> dict[str, Any]:
    """What the Debian image is built from (cheap: no network)."""
    suite = host_suite()
    arch = dpkg_arch()
    mirror = debian_mirror(suite)
    programs = _read_sources(DEBIAN_PROGRAMS)
    files = _read_sources(DEBIAN_FILES)
    layer_key = _root_key(suite, arch, mirror, DEBIAN_PACKAGES)
    h = hashlib.sha256()
    for part in (IMAGE_FORMAT, IMAGES["debian"], layer_key, json.dumps(DEBIAN_CMD), NGINX_ROOT, str(NGINX_BLOB_KIB),
                 NGINX_SEED.hex(), MODEL_PATH, MODEL_SEED.hex(), str(MODEL_COLS), str(mib)):
        h.update(part.encode() + b"\0")
    _hash_sources(h, {"program": programs, "file": files})
    return {"suite": suite, "arch": arch, "mirror": mirror, "programs": programs, "files": files, "model_mib": mib,
            "layer": os.path.join(CACHE_DIR, f"debootstrap-{suite}-{arch}-{layer_key}.tar"),
            "key": h.hexdigest()[:20]}


def torch_inputs() -> dict[str, Any]:
    """What the torch image is built from (cheap: no network)."""
    suite = host_suite()
    arch = dpkg_arch()
    mirror = debian_mirror(suite)
    programs = _read_sources(TORCH_PROGRAMS)
    layer_key = _root_key(suite, arch, mirror, TORCH_PACKAGES)
    h = hashlib.sha256()
    for part in (IMAGE_FORMAT, IMAGES["torch"], layer_key, json.dumps(TORCH_CMD), TORCH_WEIGHTS, TORCH_SEED.hex(),
                 str(MODEL_COLS), str(TORCH_MIB)):
        h.update(part.encode() + b"\0")
    _hash_sources(h, {"program": programs})
    return {"suite": suite, "arch": arch, "mirror": mirror, "programs": programs,
            "layer": os.path.join(CACHE_DIR, f"torchroot-{suite}-{arch}-{layer_key}.tar"),
            "key": h.hexdigest()[:20]}


def _build(kind: str, inputs: dict[str, Any], packages: tuple[str, ...], programs: bytes,
           weights: tuple[int, str, bytes], cmd: list[str], path: str, platform: dict[str, str]) -> None:
    """Builds the image tarball of `kind` at `path` from its debootstrap layer (made only
    when missing from the cache), `programs` (a layer) and the weights (MiB, path, seed).
    The caller holds the cache lock."""
    layer_path: str = inputs["layer"]
    if os.path.exists(layer_path):
        log(f"using cached layer {layer_path}")
    else:
        debootstrap_layer(inputs["suite"], inputs["arch"], inputs["mirror"], layer_path, packages)
    log(f"building image {IMAGES[kind]} (weights {weights[0]} MiB)")
    t0 = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="build.", dir=CACHE_DIR)
    try:
        program_layer = os.path.join(scratch, "programs.tar")
        write_file(program_layer, programs)
        weights_tar = os.path.join(scratch, "weights.tar")
        weights_layer(weights[0], weights_tar, weights[1], weights[2])
        oci_archive_file(IMAGES[kind], [layer_path, program_layer, weights_tar], cmd, platform, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"wrote {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.monotonic() - t0:.1f}s")


def build_debian(inputs: dict[str, Any], path: str, platform: dict[str, str]) -> None:
    """Builds the Debian image tarball at `path` (the caller holds the cache lock)."""
    _build("debian", inputs, DEBIAN_PACKAGES, debian_program_layer(inputs["programs"], inputs["files"]),
           (inputs["model_mib"], MODEL_PATH, MODEL_SEED), DEBIAN_CMD, path, platform)


def build_torch(inputs: dict[str, Any], path: str, platform: dict[str, str]) -> None:
    """Builds the torch image tarball at `path` (the caller holds the cache lock)."""
    _build("torch", inputs, TORCH_PACKAGES, debian_program_layer(inputs["programs"], {}, nginx=False),
           (TORCH_MIB, TORCH_WEIGHTS, TORCH_SEED), TORCH_CMD, path, platform)
