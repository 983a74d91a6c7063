"""`node-agent containerd-config`: the restore handler's containerd snippet.

Prints the tables to append to a containerd 1.6/1.7 (`version = 2`) config,
and installs the runtime launcher the snippet names, so the two always agree.
The launcher serves the restore plans of the store these settings name: it
must be run with the settings `serve` runs with (the same `--config`), and
the agent checks that it was (docs/install.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from criu_bridge.wrapper import PLAN_ANNOTATION
from node_agent.config import Settings
from node_agent.errors import InvalidArgument


def snippet(s: Settings, *, systemd_cgroup: bool = False) -> str:
    root = s.runc_root.rstrip("/")
    if os.path.basename(root) != "k8s.io":
        raise InvalidArgument(
            f"runc-root {s.runc_root} must end in /k8s.io: containerd's runc shim appends the CRI namespace to Root"
        )
    table = f'plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{s.runtime_handler}'
    return (
        f"[{table}]\n"
        f'  runtime_type = "io.containerd.runc.v2"\n'
        f"  # The wrapper refuses to start a restored container whose plan it lacks.\n"
        f'  container_annotations = ["{PLAN_ANNOTATION}"]\n'
        f"[{table}.options]\n"
        f'  BinaryName = "{os.path.abspath(s.wrapper_path)}"\n'
        f'  Root = "{os.path.abspath(os.path.dirname(root))}"\n'
        f"  SystemdCgroup = {'true' if systemd_cgroup else 'false'}\n"
    )


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
    p.add_argument("--runtime-handler", metavar="NAME")
    p.add_argument("--store", metavar="DIR")
    p.add_argument("--runc-root", metavar="DIR")
    p.add_argument("--runc", metavar="PATH")
    p.add_argument("--systemd-cgroup", action="store_true", help="set SystemdCgroup = true (match the node's runc handler)")
    p.add_argument("--no-install", action="store_true", help="only print; don't write the launcher")

    def run(args: argparse.Namespace) -> int:
        from node_agent.daemon import install_wrapper, prepare_dirs

        assert settings_from is not None
        s = settings_from(args)
        text = snippet(s, systemd_cgroup=args.systemd_cgroup)
        if not args.no_install:
            prepare_dirs(s)
            install_wrapper(s)
        sys.stdout.write(text)
        return 0

    p.set_defaults(func=run)
