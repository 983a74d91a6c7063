"""`node-agent containerd-config`: the restore handler's containerd snippet.

Prints the tables to append to containerd's config, for that file's version
(2: containerd 1.6/1.7; 3: containerd 2.x), and installs the runtime launcher
the snippet names, so the two always agree.
The launcher serves the restore plans of the store these settings name: it
must be run with the settings `serve` runs with (the same `--config`), and
the agent checks that it was (docs/install.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

CONTAINERD_CONFIG = "/etc/containerd/config.toml"

from node_agent import containerd
from node_agent.cli.configflags import HANDLER, add_flags
from node_agent.config.schema import Settings
from node_agent.errors import InvalidArgument


def snippet(s: Settings, version: int, *, systemd_cgroup: bool = False) -> str:
    """The restore handler's tables for a containerd config of `version` (2 or 3)."""
    root = s.runc_root.rstrip("/")
    if os.path.basename(root) != "k8s.io":
        raise InvalidArgument(
            f"runc-root {s.runc_root} must end in /k8s.io: containerd's runc shim appends the CRI namespace to Root"
        )
    return containerd.handler_tables(version, s.runtime_handler, binary=os.path.abspath(s.wrapper_path),
                                     root=os.path.abspath(os.path.dirname(root)), systemd_cgroup=systemd_cgroup)


def add_parser(sub: Any, settings_parent: argparse.ArgumentParser | None = None, settings_from: Callable[..., Settings] | None = None) -> None:
    p = sub.add_parser(
        "containerd-config",
        help="print the restore handler's containerd config snippet (and install its runtime launcher)",
        description=(
            "Print the restore handler's tables for containerd's config and install the runtime launcher they name. "
            "The launcher serves the restore plans of the store these settings name, so give it exactly the "
            "settings `serve` runs with (the same --config FILE, or the same --store and --runc-root). The agent "
            "checks this before every restore, through containerd's own account of the handler, and refuses to "
            "restore (FAILED_PRECONDITION) when they differ; `node-agent doctor` reports it too."
        ),
    )
    p.add_argument("--config", metavar="FILE",
                   help="the agent's YAML config: the same file `serve` reads (store, runc-root and "
                        "runtime-handler must match the daemon's, or restores are refused)")
    add_flags(p, HANDLER, described=False)
    p.add_argument("--containerd-config", metavar="FILE", default=CONTAINERD_CONFIG,
                   help=f"containerd's config, whose version (2 or 3) the tables are for (default {CONTAINERD_CONFIG}); "
                        "its runc handler's SystemdCgroup is followed too")
    p.add_argument("--config-version", type=int, choices=containerd.VERSIONS,
                   help="write for this config version instead of reading it from --containerd-config "
                        "(2: containerd 1.6/1.7, 3: containerd 2.x)")
    p.add_argument("--systemd-cgroup", action="store_true", help="set SystemdCgroup = true (match the node's runc handler)")
    p.add_argument("--no-install", action="store_true", help="only print; don't write the launcher")

    def run(args: argparse.Namespace) -> int:
        from node_agent.daemon import install_wrapper, prepare_dirs

        assert settings_from is not None
        s = settings_from(args)
        version, cgroup = args.config_version, args.systemd_cgroup
        if version is None:
            # Read from the file, never guessed: containerd 2.x ignores tables of the wrong version.
            version = containerd.version_of_file(args.containerd_config)
            with open(args.containerd_config, encoding="utf-8") as fh:
                cgroup = cgroup or containerd.systemd_cgroup(containerd.parse(fh.read(1 << 20)), version)
        text = snippet(s, version, systemd_cgroup=cgroup)
        if not args.no_install:
            prepare_dirs(s)
            install_wrapper(s)
        sys.stdout.write(text)
        return 0

    p.set_defaults(func=run)
