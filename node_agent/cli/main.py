"""Entry point: `node-agent COMMAND ...`."""

from __future__ import annotations

import argparse
import sys

from node_agent import errors
from node_agent.cli import checkpoints, containerd_config, devices, doctor, install_systemd, restores, transfer
from node_agent.cli.client import ENV_SOCKET, CliError, remote_of
from node_agent.cli.configflags import LISTENERS, SERVE, add_flags, settings_from, settings_parent


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
    add_flags(p, LISTENERS + SERVE)
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
