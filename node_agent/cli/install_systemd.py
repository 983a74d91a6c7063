"""`node-agent install-systemd` and `install-handler`: put node-agent on a node.

Restore runs inside the node's containerd shim, which runs the restore
handler's wrapper, runc and CRIU on the host. So every way of installing
puts three things on the host, under `--root` (default `/`):

* the wrapper, `<store>/bin/node-agent-runc`, with the interpreter it runs
  on: this installation's Python (systemd), or a relocatable Python copied
  from `--runtime-bundle` (the DaemonSet's init container, whose config
  names it as `wrapper-python` so that `serve` leaves the wrapper alone);
* CRIU >= 4.2 when the host lacks it: the private prefix that
  scripts/install-host builds (`--criu-bundle`, default
  /opt/node-agent/criu) and the launcher `/usr/local/sbin/criu`;
* the handler's tables in containerd's config (version 2 or 3, the file's own), between two
  marker lines, replaced on every run; containerd must be restarted to load
  them.

`install-systemd` adds the unit (`/etc/systemd/system/node-agent.service`,
ExecStart pointing at this node-agent) and a default config that is never
overwritten. Nothing here runs systemctl: the command prints what to run.
Files are written atomically; a second run changes nothing it need not.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec

from node_agent import containerd
from node_agent.config.schema import DEFAULT_CONFIG_PATH, Settings
from node_agent.errors import FailedPrecondition, InvalidArgument

UNIT_NAME = "node-agent.service"
UNIT_DIR = "/etc/systemd/system"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CRIU_PREFIX = "/opt/node-agent/criu"
CRIU_LAUNCHER = "/usr/local/sbin/criu"
RUNTIME_PREFIX = "/opt/node-agent/runtime"
MIN_CRIU = (4, 2)
BEGIN = "# BEGIN node-agent restore handler (node-agent install-handler; do not edit)"
END = "# END node-agent restore handler"
# Where a host's runc usually lies, in the order runc is looked up on PATH.
RUNC_PLACES = ("/usr/local/sbin/runc", "/usr/local/bin/runc", "/usr/sbin/runc", "/usr/bin/runc", "/sbin/runc", "/bin/runc")

DEFAULT_CONFIG = """\
# node-agent's config: keys are `node-agent serve`'s flag names.
store: {store}
socket: {socket}
runtime-handler: {handler}
runc-root: {runc_root}
health-listen: 127.0.0.1:9440
"""


@dataclass
class Report:
    """What an install did, and what the operator must still do."""

    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def file(self, path: str, changed: bool) -> None:
        (self.written if changed else self.unchanged).append(path)


def unit_source() -> str:
    """The unit file shipped with this installation (systemd/node-agent.service)."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "systemd" / UNIT_NAME, Path(sys.prefix) / "share" / "node-agent" / UNIT_NAME):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    raise FailedPrecondition(f"{UNIT_NAME} not found next to this installation")


def render_unit(template: str, executable: str, config: str) -> str:
    """The unit with ExecStart running `executable serve --config config`."""
    text, n = re.subn(r"(?m)^ExecStart=.*$", f"ExecStart={executable} serve --config {config}", template)
    if n != 1:
        raise FailedPrecondition(f"{UNIT_NAME} must have exactly one ExecStart= line")
    return text


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root != "/" else path


def _write(path: str, text: str, mode: int) -> bool:
    """Write atomically; False when the file already had this content and mode."""
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text and (os.stat(path).st_mode & 0o7777) == mode:
                return False
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


def _copy_tree(src: str, dest: str) -> None:
    """Replace `dest` by a copy of `src` (staged beside it, then renamed)."""
    stage, old = dest + ".new", dest + ".old"
    for d in (stage, old):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copytree(src, stage, symlinks=True)
    if os.path.lexists(dest):
        os.rename(dest, old)
    os.rename(stage, dest)
    shutil.rmtree(old, ignore_errors=True)


# ---- CRIU ----------------------------------------------------------------------


def _criu_version(argv: list[str]) -> tuple[int, int] | None:
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^Version:\s*(\d+)\.(\d+)", out, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _bundle_loader(prefix: str) -> str:
    """The dynamic loader inside a CRIU prefix, relative to it."""
    found = sorted(glob.glob(os.path.join(prefix, "usr/lib/*/ld-linux*.so.*")) + glob.glob(os.path.join(prefix, "usr/lib/*/ld64.so.*")))
    if not found:
        raise FailedPrecondition(f"{prefix} has no dynamic loader under usr/lib/*/: not a CRIU prefix from scripts/install-host")
    return os.path.relpath(found[0], prefix)


def criu_launcher(prefix: str, loader: str, version: str) -> str:
    libdir = os.path.join(prefix, os.path.dirname(loader))
    return (
        "#!/bin/sh\n"
        f"# CRIU {version} from a private prefix (installed by node-agent install-handler).\n"
        f'exec {os.path.join(prefix, loader)} --library-path {libdir} {prefix}/usr/sbin/criu "$@"\n'
    )


def install_criu(root: str, bundle: str, report: Report, *, force: bool = False) -> None:
    """CRIU >= 4.2 on the host: the bundle and its launcher, unless the host has it."""
    if bundle == "none":
        report.notes.append("CRIU not installed (--criu-bundle none): the host's criu on PATH must be >= 4.2")
        return
    if not os.path.isfile(os.path.join(bundle, "usr/sbin/criu")):
        raise FailedPrecondition(f"{bundle} is not a CRIU prefix (no usr/sbin/criu): run scripts/install-host or pass --criu-bundle")
    version = Path(bundle, ".criu-version").read_text(encoding="utf-8").strip() if os.path.exists(os.path.join(bundle, ".criu-version")) else "?"
    dest = _under(root, CRIU_PREFIX)
    launcher = _under(root, CRIU_LAUNCHER)
    if not force:
        if root == "/":
            have = _criu_version([shutil.which("criu", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin") or "criu"])
            if have is not None and have >= MIN_CRIU:
                report.notes.append(f"CRIU {have[0]}.{have[1]} already on the host's PATH")
                return
        else:
            installed = os.path.join(dest, ".criu-version")
            if os.path.exists(installed) and os.path.exists(launcher) and Path(installed).read_text(encoding="utf-8").strip() == version:
                report.file(dest, False)
                report.file(launcher, False)
                return
    loader = _bundle_loader(bundle)
    if os.path.realpath(bundle) != os.path.realpath(dest):
        _copy_tree(bundle, dest)
        report.file(dest, True)
    report.file(launcher, _write(launcher, criu_launcher(CRIU_PREFIX, loader, version), 0o755))


# ---- containerd ----------------------------------------------------------------


def _handler_block(snippet_text: str) -> str:
    return f"{BEGIN}\n{snippet_text.rstrip()}\n{END}\n"


def merge_containerd_config(current: str | None, snippet_text: str, version: int) -> str:
    """containerd's config with the handler block added or replaced (a new config gets `version`).

    The file's own version must be `version` (containerd 2.x ignores tables
    of the other layout); a config that already defines the handler outside
    the block is refused.
    """
    if current is None or not current.strip():
        return f"version = {version}\n\n" + _handler_block(snippet_text)
    block = re.compile(rf"(?ms)^{re.escape(BEGIN)}\n.*?^{re.escape(END)}\n?")
    rest = block.sub("", current)
    doc = containerd.parse(rest)
    have = containerd.version_of(doc)
    if have != version:
        raise FailedPrecondition(f"containerd's config has version = {have}, the handler's tables are for version {version}")
    handler = next(iter(containerd.runtimes(containerd.parse(snippet_text), version)))
    if handler in containerd.runtimes(doc, version):
        raise FailedPrecondition(f"containerd's config already defines runtime {handler!r} outside node-agent's block; remove it first")
    merged = rest.rstrip("\n") + "\n\n" + _handler_block(snippet_text)
    containerd.parse(merged)
    return merged


def config_version(root: str, current: str | None, given: int | None) -> int:
    """The version of containerd's config to write for: the file's own, else `given`, else the host containerd's."""
    if current is not None and current.strip():
        version = containerd.version_of(containerd.parse(current))
        if given is not None and given != version:
            raise FailedPrecondition(f"containerd's config has version = {version}, not {given}")
        return version
    if given is not None:
        return given
    binary = shutil.which("containerd", path=":".join(_under(root, d) for d in ("/usr/local/bin", "/usr/bin", "/bin")))
    if binary is None:
        raise FailedPrecondition("containerd's config does not exist and no containerd is on the host to tell its "
                                 "version: give --config-version 2 (containerd 1.6/1.7) or 3 (containerd 2.x)")
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout.split()
    return containerd.version_for_binary(out[2] if len(out) > 2 else "")


def register_handler(root: str, s: Settings, config_path: str, report: Report, given_version: int | None = None) -> None:
    from node_agent.cli.containerd_config import snippet

    path = _under(root, config_path)
    try:
        current: str | None = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    version = config_version(root, current, given_version)
    cgroup = bool(current) and containerd.systemd_cgroup(containerd.parse(current or ""), version)
    text = merge_containerd_config(current, snippet(s, version, systemd_cgroup=cgroup), version)
    changed = _write(path, text, 0o644 if current is None else os.stat(path).st_mode & 0o7777)
    report.file(path, changed)
    if changed:
        report.notes.append(f"restart containerd to load the {s.runtime_handler!r} handler (systemctl restart containerd)")


# ---- the wrapper ---------------------------------------------------------------


def host_runc(root: str, s: Settings) -> str:
    """The host's runc, as a host path."""
    if os.path.isabs(s.runc):
        return s.runc
    if root == "/":
        from node_agent.daemon import resolve_runc

        return resolve_runc(s)
    for place in RUNC_PLACES:
        if os.access(_under(root, place), os.X_OK):
            return place
    raise FailedPrecondition(f"no runc under {root} ({', '.join(RUNC_PLACES)}); pass --runc with the host's path")


def install_wrapper(root: str, s: Settings, python: str, report: Report) -> str:
    from criu_bridge import wrapper

    from node_agent.daemon import prepare_dirs

    runc = host_runc(root, s)
    prepare_dirs(msgspec.structs.replace(s, store=_under(root, s.store)))
    path = _under(root, s.wrapper_path)
    changed = wrapper.install(path, python=python, runc=runc, plans_dir=s.plans_dir)
    report.file(path, changed)
    return path


def install_runtime(root: str, bundle: str, report: Report) -> str:
    """Copy a relocatable Python with criu_bridge to the host; its python3 as a host path."""
    if not os.access(os.path.join(bundle, "bin", "python3"), os.X_OK):
        raise FailedPrecondition(f"{bundle} has no bin/python3: not a runtime bundle (deploy/image/bundle-runtime)")
    dest = _under(root, RUNTIME_PREFIX)
    if os.path.realpath(bundle) != os.path.realpath(dest):
        _copy_tree(bundle, dest)
        report.file(dest, True)
    return os.path.join(RUNTIME_PREFIX, "bin", "python3")


# ---- the commands --------------------------------------------------------------


def install_handler(root: str, s: Settings, *, containerd_config: str = CONTAINERD_CONFIG, criu_bundle: str = CRIU_PREFIX,
                    runtime_bundle: str | None = None, force_criu: bool = False,
                    config_version: int | None = None) -> Report:
    report = Report()
    root = os.path.abspath(root)
    if runtime_bundle:
        python = os.path.join(RUNTIME_PREFIX, "bin", "python3")
        if s.wrapper_python and s.wrapper_python != python:
            raise InvalidArgument(f"wrapper-python is {s.wrapper_python}, but --runtime-bundle installs {python}")
        install_runtime(root, runtime_bundle, report)
    else:
        python = s.wrapper_python or sys.executable
    install_wrapper(root, s, python, report)
    install_criu(root, criu_bundle, report, force=force_criu)
    register_handler(root, s, containerd_config, report, config_version)
    return report


def install_systemd(root: str, s: Settings, *, config_path: str = DEFAULT_CONFIG_PATH, executable: str | None = None,
                    **handler: Any) -> Report:
    root = os.path.abspath(root)
    report = install_handler(root, s, **handler)
    exe = executable or str(Path(sys.executable).parent / "node-agent")
    unit = _under(root, os.path.join(UNIT_DIR, UNIT_NAME))
    report.file(unit, _write(unit, render_unit(unit_source(), exe, config_path), 0o644))
    cfg = _under(root, config_path)
    if os.path.exists(cfg):
        report.file(cfg, False)
    else:
        text = DEFAULT_CONFIG.format(store=s.store, socket=s.socket, handler=s.runtime_handler, runc_root=s.runc_root)
        report.file(cfg, _write(cfg, text, 0o644))
    report.notes.append("then: systemctl daemon-reload && systemctl enable --now node-agent")
    return report


def _print(report: Report) -> None:
    for p in report.written:
        sys.stdout.write(f"installed {p}\n")
    for p in report.unchanged:
        sys.stdout.write(f"unchanged {p}\n")
    for n in report.notes:
        sys.stdout.write(f"note: {n}\n")


def add_parsers(sub: Any, parent: argparse.ArgumentParser, settings_from: Callable[[argparse.Namespace], Settings]) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--root", metavar="DIR", default="/", help="install under DIR instead of / (the host's root)")
        p.add_argument("--containerd-config", metavar="FILE", default=CONTAINERD_CONFIG,
                       help=f"containerd's config, a host path (default {CONTAINERD_CONFIG})")
        p.add_argument("--criu-bundle", metavar="DIR", default=CRIU_PREFIX,
                       help=f"CRIU prefix to install when the host has no CRIU >= 4.2 (default {CRIU_PREFIX}; 'none' to skip)")
        p.add_argument("--force-criu", action="store_true", help="install the CRIU bundle even if the host has CRIU >= 4.2")
        p.add_argument("--config-version", type=int, choices=containerd.VERSIONS,
                       help="the version of containerd's config to write, when the file does not exist yet "
                            "(default: the host containerd's: 2 for 1.6/1.7, 3 for 2.x)")

    def handler_args(args: argparse.Namespace) -> dict[str, Any]:
        return {"containerd_config": args.containerd_config, "criu_bundle": args.criu_bundle, "force_criu": args.force_criu,
                "config_version": args.config_version}

    p = sub.add_parser("install-systemd", parents=[parent],
                       help="install the systemd unit, the restore wrapper, CRIU if needed and the containerd handler",
                       description="--config FILE is the unit's config, a host path under --root (default "
                                   f"{DEFAULT_CONFIG_PATH}): read when it exists, else written with the given settings.")
    common(p)
    p.add_argument("--executable", metavar="PATH", help="node-agent for ExecStart (default: this one)")

    def run_systemd(args: argparse.Namespace) -> int:
        # --config is the unit's config, a path on the host (under --root):
        # its settings are used when it exists, else it is written.
        config_path = args.config or DEFAULT_CONFIG_PATH
        on_root = _under(os.path.abspath(args.root), config_path)
        args.config = on_root if os.path.exists(on_root) else None
        s = settings_from(args)
        _print(install_systemd(args.root, s, config_path=config_path, executable=args.executable, **handler_args(args)))
        return 0

    p.set_defaults(func=run_systemd)

    h = sub.add_parser("install-handler", parents=[parent],
                       help="install the restore wrapper, CRIU if needed and the containerd handler (DaemonSet init container)")
    common(h)
    h.add_argument("--runtime-bundle", metavar="DIR",
                   help=f"relocatable Python to run the wrapper on, copied to {RUNTIME_PREFIX} (the image's /opt/node-agent/runtime)")

    def run_handler(args: argparse.Namespace) -> int:
        s = settings_from(args)
        _print(install_handler(args.root, s, runtime_bundle=args.runtime_bundle, **handler_args(args)))
        return 0

    h.set_defaults(func=run_handler)
