"""Entry point: `node-agent COMMAND ...`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, get_args

import msgspec

from node_agent import errors
from node_agent.cli import checkpoints, containerd_config, devices, doctor, install_systemd, restores, transfer
from node_agent.cli.client import ENV_SOCKET, CliError, remote_of
from node_agent.config import Document, LogFormat, LogLevel, Settings, load

_DEFAULT = Settings()


def settings_parent() -> argparse.ArgumentParser:
    """Flags shared by commands that build Settings (serve, doctor, containerd-config)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", metavar="FILE", help="YAML config file; flags override it")
    p.add_argument("--cri-endpoint", metavar="URL", help=f"CRI endpoint (default {_DEFAULT.cri_endpoint})")
    p.add_argument("--socket", metavar="PATH", help=f"local API socket (default {_DEFAULT.socket})")
    p.add_argument("--cri-listen", metavar="URL", help="serve the CRI for the kubelet here (unix:///path; off by default)")
    p.add_argument("--store", metavar="DIR", help=f"checkpoint store (default {_DEFAULT.store})")
    p.add_argument("--runtime-handler", metavar="NAME", help=f"restore runtime handler (default {_DEFAULT.runtime_handler})")
    p.add_argument("--runc-root", metavar="DIR", help=f"runc root of CRI containers (default {_DEFAULT.runc_root})")
    p.add_argument("--runc", metavar="PATH", help="runc binary (default: runc on PATH)")
    p.add_argument("--criu", metavar="PATH", help="criu binary (default: criu on PATH)")
    p.add_argument("--log-format", choices=get_args(LogFormat), help="daemon log format")
    p.add_argument("--log-level", choices=get_args(LogLevel))
    return p


def settings_from(args: argparse.Namespace) -> Any:
    """Settings from `--config` and the flags given; a flag's dest is the attribute of its config key."""
    keys = (f.name for f in msgspec.structs.fields(Document))
    return load(args.config, {k: getattr(args, k, None) for k in keys})


def add_listener_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", metavar="HOST:PORT", help="serve the API here with mutual TLS (off by default)")
    p.add_argument("--tls-cert", metavar="FILE", help="the TLS listener's PEM certificate chain (reloaded on change)")
    p.add_argument("--tls-key", metavar="FILE", help="the TLS listener's PEM private key (reloaded on change)")
    p.add_argument("--tls-client-ca", metavar="FILE", help="PEM CA bundle that client certificates must chain to")
    p.add_argument("--health-listen", metavar="[HOST:]PORT", help="plaintext grpc.health.v1 (loopback by default)")
    p.add_argument("--metrics-listen", metavar="[HOST:]PORT", help="Prometheus metrics at /metrics (loopback by default)")


def cmd_serve(args: argparse.Namespace) -> int:
    from node_agent import logconfig
    from node_agent.daemon import run

    s = settings_from(args)
    logconfig.setup(s.log_format, s.log_level)
    return run(s)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="node-agent", description="Pod checkpoint/restore and device health on a Kubernetes node.")
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", metavar="PATH", help=f"the daemon's local socket (env {ENV_SOCKET})")
    common.add_argument("--server", metavar="HOST:PORT", help="use the daemon's mutual-TLS listener instead")
    common.add_argument("--cert", metavar="FILE", help="client certificate (PEM) for --server")
    common.add_argument("--key", metavar="FILE", help="client private key (PEM) for --server")
    common.add_argument("--ca", metavar="FILE", help="CA (PEM) the server's certificate chains to, for --server")
    sp = settings_parent()

    p = sub.add_parser("serve", parents=[sp], help="run the daemon")
    add_listener_flags(p)
    p.add_argument("--sysfs-root", metavar="DIR", help=f"the sysfs tree the device inventory reads (default {_DEFAULT.sysfs_root})")
    p.set_defaults(func=cmd_serve)
    checkpoints.add_parsers(sub, common)
    restores.add_parsers(sub, common)
    transfer.add_parsers(sub, common)
    devices.add_parsers(sub, common)
    doctor.add_parser(sub, sp, settings_from)
    containerd_config.add_parser(sub, None, settings_from)
    install_systemd.add_parsers(sub, sp, settings_from)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # Refuse a half-given TLS target before anything runs.
        remote_of(getattr(args, "server", None), getattr(args, "cert", None), getattr(args, "key", None),
                  getattr(args, "ca", None))
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
