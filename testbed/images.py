"""The bed's images: busybox, pause, memhog, Debian and torch, built once into a cache and imported.

The small images are busybox (static) and binaries compiled static from
scripts/testbed_images; the Debian and torch images are testbed/debian.py's. The cache
(/var/cache/node-agent-testbed/images) keys every tarball by what it is
built from, and drops what a rebuild replaced.

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from testbed.debian import build_debian, build_torch, debian_inputs, remove_rootfs, torch_inputs
from testbed.host import TestbedError, log, run, write_file
from testbed.layout import CACHE_DIR, IMAGE_FORMAT, IMAGE_SOURCES, IMAGES, BedLayout, Lock
from testbed.oci import Layer, elf_is_static, oci_archive, oci_platform
from testbed.weights import MODEL_MIB_DEFAULT

def busybox_binary() -> str:
    for path in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.isfile(path):
            if not elf_is_static(path):
                raise TestbedError(f"{path} is not statically linked (install busybox-static)")
            return path
    raise TestbedError("busybox not found (install busybox-static)")


def busybox_layer(busybox: str) -> bytes:
    layer = Layer()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "usr/local/bin", "etc", "root", "data",
              "dev", "dev/shm", "proc", "sys", "run", "var", "home"):
        layer.dir(d)
    layer.dir("tmp", 0o1777)
    layer.dir("var/tmp", 0o1777)
    with open(busybox, "rb") as f:
        layer.file("bin/busybox", f.read(), 0o755)
    applets = run([busybox, "--list-full"]).stdout.decode().split()
    for applet in sorted(set(applets)):
        if applet.strip("/") != "bin/busybox":
            layer.symlink(applet, "/bin/busybox")
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    layer.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
    return layer.finish()


def binary_layer(files: dict[str, bytes]) -> bytes:
    layer = Layer()
    for d in ("dev", "proc", "sys", "etc", "tmp"):
        layer.dir(d, 0o1777 if d == "tmp" else 0o755)
    for path, data in files.items():
        layer.file(path, data, 0o755)
    return layer.finish()


def compile_static(source: str, out: str) -> None:
    run(["gcc", "-O2", "-static", "-Wall", "-o", out, source], timeout=120)
    if not elf_is_static(out):
        raise TestbedError(f"{out} is not statically linked")


def _cache_family(entry: str) -> str:
    """What a cached tarball is a version of: `busybox`, `debian-64m` (one per model
    size), `debootstrap` or `torchroot` (any suite), or `debian` (a tarball of an older
    layout)."""
    head = entry[: -len(".tar")].rsplit("-", 1)[0]
    for family in ("debootstrap", "torchroot"):
        if head.startswith(f"{family}-"):
            return family
    return head


def build_images(kinds: list[str], mib: int = MODEL_MIB_DEFAULT) -> dict[str, str]:
    """Builds (or takes from the cache) the image tarballs of `kinds`; returns key -> path.
    `mib`: the size of the Debian image's model weights."""
    platform = oci_platform()
    debian = debian_inputs(mib) if "debian" in kinds else None
    torch = torch_inputs() if "torch" in kinds else None
    busybox = busybox_binary()
    with open(busybox, "rb") as f:
        busybox_sum = hashlib.sha256(f.read()).hexdigest()
    gcc = " ".join(run(["gcc", flag]).stdout.decode().strip() for flag in ("-dumpfullversion", "-dumpmachine"))
    sources = {}
    for prog in ("pause", "memhog"):
        path = os.path.join(IMAGE_SOURCES, f"{prog}.c")
        try:
            with open(path, "rb") as f:
                sources[prog] = (path, f.read())
        except OSError as exc:
            raise TestbedError(f"cannot read {path}: {exc.strerror}") from exc

    def key(kind: str) -> str:
        h = hashlib.sha256()
        for part in (IMAGE_FORMAT, IMAGES[kind], json.dumps(platform, sort_keys=True), busybox_sum, gcc):
            h.update(part.encode() + b"\0")
        if kind in sources:
            h.update(sources[kind][1])
        return h.hexdigest()[:20]

    os.makedirs(CACHE_DIR, exist_ok=True)
    paths = {}
    with Lock(os.path.join(CACHE_DIR, ".lock")):
        missing = {}
        for kind in kinds:
            if debian and kind == "debian":
                name = f"debian-{mib}m-{debian['key']}"
            elif torch and kind == "torch":
                name = f"torch-{torch['key']}"
            else:
                name = f"{kind}-{key(kind)}"
            path = os.path.join(CACHE_DIR, f"{name}.tar")
            paths[kind] = path
            if not os.path.exists(path):
                missing[kind] = path
        if debian is not None and "debian" in missing:
            build_debian(debian, missing.pop("debian"), platform)
        if torch is not None and "torch" in missing:
            build_torch(torch, missing.pop("torch"), platform)
        if missing:
            with tempfile.TemporaryDirectory(prefix="testbed-build-") as tmp:
                bins = {}
                for prog, (src, _) in sources.items():
                    out = os.path.join(tmp, prog)
                    compile_static(src, out)
                    with open(out, "rb") as f:
                        bins[prog] = f.read()
                base_layer = busybox_layer(busybox) if {"busybox", "memhog"} & set(missing) else b""
                for kind, path in missing.items():
                    log(f"building image {IMAGES[kind]}")
                    if kind == "busybox":
                        data = oci_archive(IMAGES[kind], [base_layer], ["sh"], platform)
                    elif kind == "pause":
                        data = oci_archive(IMAGES[kind], [binary_layer({"pause": bins["pause"]})],
                                           ["/pause"], platform)
                    else:
                        data = oci_archive(IMAGES[kind],
                                           [base_layer, binary_layer({"usr/local/bin/memhog": bins["memhog"]})],
                                           ["/usr/local/bin/memhog"], platform)
                    write_file(path, data)
        keep = set(paths.values()) | {inputs["layer"] for inputs in (debian, torch) if inputs}
        # Only what this build would rebuild: a Debian image of another model size stays.
        ours = [k for k in kinds if k != "debian"] + (["debian", f"debian-{mib}m", "debootstrap"] if debian else [])
        ours += ["torchroot"] if torch else []
        for entry in os.listdir(CACHE_DIR):
            full = os.path.join(CACHE_DIR, entry)
            if entry.endswith(".tar") and full not in keep and _cache_family(entry) in ours:
                os.unlink(full)
            elif ".tar.tmp." in entry:  # what an interrupted build left (we hold the lock)
                os.unlink(full)
            elif entry.startswith("rootfs.") and os.path.isdir(full):
                log(f"removing stale {full}")
                remove_rootfs(full)
            elif entry.startswith("build.") and os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
    return paths


def import_images(bed: BedLayout, tarballs: dict[str, str]) -> None:
    for kind, path in tarballs.items():
        log(f"importing {IMAGES[kind]}")
        bed.ctr("images", "import", path, timeout=300)
    listed = set(bed.ctr("images", "ls", "-q").stdout.decode().split())
    missing = [IMAGES[kind] for kind in tarballs if IMAGES[kind] not in listed]
    if missing:
        raise TestbedError(f"image import did not create {', '.join(missing)} (have: {', '.join(sorted(listed))})")
