"""containerd's config file, version 2 (containerd 1.6/1.7) and version 3 (containerd 2.x).

The restore handler is a table of runtime options; where it goes depends on
the file's version:

- version 2: ``plugins."io.containerd.grpc.v1.cri".containerd.runtimes.NAME``;
- version 3: ``plugins."io.containerd.cri.v1.runtime".containerd.runtimes.NAME``,
  with ``sandboxer = "podsandbox"`` (the sandbox is a pause container, as
  with 1.x; the shim sandboxer has no place for a restore).

containerd 2.x ignores version-2 tables appended to a version-3 file (only a
warning in its log), so the version is never guessed: it is read from the
file, or given.
"""

from __future__ import annotations

import tomllib
from typing import Any, Mapping

from criu_bridge.wrapper import PLAN_ANNOTATION
from node_agent.errors import FailedPrecondition, InvalidArgument

VERSIONS = (2, 3)
# The CRI plugins. Version 2 has one, io.containerd.grpc.v1.cri; version 3 splits
# it into the runtime part (the runtime handlers, CNI, CDI), the images part
# (snapshotter, pinned images, registry) and the server, where only the
# streaming settings are left.
CRI = "io.containerd.grpc.v1.cri"
CRI_RUNTIME = "io.containerd.cri.v1.runtime"
CRI_IMAGES = "io.containerd.cri.v1.images"
# The plugin whose `containerd.runtimes` table holds the runtime handlers, by version.
RUNTIME_PLUGIN = {2: CRI, 3: CRI_RUNTIME}
_RUNTIMES = {version: ("plugins", plugin, "containerd", "runtimes") for version, plugin in RUNTIME_PLUGIN.items()}
SANDBOXER = "podsandbox"


def parse(text: str, what: str = "containerd's config") -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{what} is not valid TOML: {exc}") from exc


def version_of(doc: Mapping[str, Any], what: str = "containerd's config") -> int:
    """The file's `version`: 2 or 3 (a file without one is version 1, which no supported containerd reads)."""
    version = doc.get("version", 1)
    if version not in VERSIONS:
        raise FailedPrecondition(
            f"{what} has version = {version}; node-agent writes version 2 (containerd 1.6/1.7) and "
            "version 3 (containerd 2.x)"
        )
    return int(version)


def runtimes(doc: Mapping[str, Any], version: int) -> Mapping[str, Any]:
    """The runtime handler tables of a parsed config of `version`."""
    node: Any = doc
    for key in _RUNTIMES[version]:
        node = node.get(key, {}) if isinstance(node, Mapping) else {}
    return node if isinstance(node, Mapping) else {}


def all_runtimes(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime handler tables of a parsed config in either version's layout (version 3's win)."""
    found = dict(runtimes(doc, 2))
    found.update(runtimes(doc, 3))
    return found


def plugin_table(plugin: str) -> str:
    """The TOML table name of `plugin`'s settings: plugins."NAME"."""
    return f'plugins."{plugin}"'


def containerd_table(version: int) -> str:
    """The TOML table name of the CRI runtime settings (default_runtime_name) in a config of `version`."""
    plugins, plugin, containerd, _ = _RUNTIMES[version]
    return f'{plugins}."{plugin}".{containerd}'


def table(version: int, handler: str) -> str:
    """The TOML table name of runtime handler `handler` in a config of `version`."""
    plugins, plugin, containerd, runtimes_ = _RUNTIMES[version]
    return f'{plugins}."{plugin}".{containerd}.{runtimes_}.{handler}'


def handler_tables(version: int, handler: str, *, binary: str, root: str, systemd_cgroup: bool) -> str:
    """The restore handler's tables for a config of `version`."""
    name = table(version, handler)
    lines = [f"[{name}]", '  runtime_type = "io.containerd.runc.v2"']
    if version == 3:
        lines.append(f'  sandboxer = "{SANDBOXER}"')
    lines += [
        "  # The wrapper refuses to start a restored container whose plan it lacks.",
        f'  container_annotations = ["{PLAN_ANNOTATION}"]',
        f"[{name}.options]",
        f'  BinaryName = "{binary}"',
        f'  Root = "{root}"',
        f"  SystemdCgroup = {'true' if systemd_cgroup else 'false'}",
    ]
    return "\n".join(lines) + "\n"


def version_of_file(path: str) -> int:
    """The version of containerd's config at `path`; FailedPrecondition when it cannot be told."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(1 << 20)
    except FileNotFoundError as exc:
        raise FailedPrecondition(
            f"no containerd config at {path}: cannot tell which version to write; give --config-version 2 "
            "(containerd 1.6/1.7) or 3 (containerd 2.x), or --containerd-config FILE"
        ) from exc
    except OSError as exc:
        raise FailedPrecondition(f"cannot read {path}: {exc.strerror}") from exc
    return version_of(parse(text, path), path)


def version_for_binary(version_text: str) -> int:
    """The config version a containerd that reports `version_text` (`1.7.24`, `v2.1.9`) reads."""
    v = version_text.strip().lstrip("v")
    major = v.split(".", 1)[0]
    if not major.isascii() or not major.isdigit():
        raise FailedPrecondition(f"cannot tell containerd's major version from {version_text!r}")
    return 3 if int(major) >= 2 else 2


def systemd_cgroup(doc: Mapping[str, Any], version: int) -> bool:
    """Whether the node's runc handler uses the systemd cgroup driver (the restore handler must match)."""
    runc = runtimes(doc, version).get("runc", {})
    opts = runc.get("options", {}) if isinstance(runc, Mapping) else {}
    return bool(opts.get("SystemdCgroup", False)) if isinstance(opts, Mapping) else False

