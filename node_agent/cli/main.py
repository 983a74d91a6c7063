"""Entry point: `node-agent COMMAND ...`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from node_agent import errors
from node_agent.cli import checkpoints, containerd_config, doctor, transfer
from node_agent.cli.client import ENV_SOCKET, CliError
from node_agent.config import load


def settings_parent() -> argparse.ArgumentParser:
    """Flags shared by commands that build Settings (serve, doctor, containerd-config)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", metavar="FILE", help="YAML config file; flags override it")
    p.add_argument("--cri-endpoint", metavar="URL", help="CRI endpoint (default unix:///run/containerd/containerd.sock)")
    p.add_argument("--socket", metavar="PATH", help="local API socket (default /run/node-agent/agent.sock)")
    p.add_argument("--store", metavar="DIR", help="checkpoint store (default /var/lib/node-agent)")
    p.add_argument("--runtime-handler", metavar="NAME", help="restore runtime handler (default criu)")
    p.add_argument("--runc-root", metavar="DIR", help="runc root of CRI containers (default /run/containerd/runc/k8s.io)")
    p.add_argument("--runc", metavar="PATH", help="runc binary (default: runc on PATH)")
    p.add_argument("--criu", metavar="PATH", help="criu binary (default: criu on PATH)")
    p.add_argument("--log-format", choices=["text", "json"], help="daemon log format")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def settings_from(args: argparse.Namespace) -> Any:
    keys = ("cri_endpoint", "socket", "store", "runtime_handler", "runc_root", "runc", "criu", "log_format", "log_level")
    return load(args.config, {k: getattr(args, k, None) for k in keys})


def cmd_serve(args: argparse.Namespace) -> int:
    from node_agent import logconfig
    from node_agent.daemon import serve

    s = settings_from(args)
    logconfig.setup(s.log_format, s.log_level)
    asyncio.run(serve(s))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="node-agent", description="Pod checkpoint/restore and device health on a Kubernetes node.")
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", metavar="PATH", help=f"the daemon's local socket (env {ENV_SOCKET})")
    sp = settings_parent()

    p = sub.add_parser("serve", parents=[sp], help="run the daemon")
    p.set_defaults(func=cmd_serve)
    checkpoints.add_parsers(sub, common)
    transfer.add_parsers(sub, common)
    doctor.add_parser(sub, sp, settings_from)
    containerd_config.add_parser(sub, None, settings_from)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as exc:
        sys.stderr.write(f"node-agent: {exc}\n")
        return exc.code
    except errors.AgentError as exc:
        sys.stderr.write(f"node-agent: {exc.code}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
