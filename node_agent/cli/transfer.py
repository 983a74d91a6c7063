"""push, pull, export and import: checkpoints in and out of the node's store."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import Any

from node_agent.cli import output
from node_agent.cli.checkpoints import stream_result
from node_agent.cli.client import Client, pb

ENV_USER = "NODE_AGENT_REGISTRY_USERNAME"
ENV_PASSWORD = "NODE_AGENT_REGISTRY_PASSWORD"


def _credentials(args: argparse.Namespace) -> Any:
    password = os.environ.get(ENV_PASSWORD, "")
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    username = args.username or os.environ.get(ENV_USER, "")
    if username and not password and sys.stdin.isatty():
        password = getpass.getpass(f"password for {username}: ")
    ca = os.path.abspath(args.ca_file) if args.ca_file else ""
    return pb.RegistryCredentials(
        username=username, password=password, ca_file=ca,
        plain_http=args.plain_http, insecure_skip_verify=args.insecure_skip_verify,
    )


def cmd_push(args: argparse.Namespace) -> int:
    r = stream_result(args, "Push", pb.PushRequest(checkpoint_id=args.id, reference=args.reference, credentials=_credentials(args)))
    if args.output == "json":
        output.emit(output.as_dict(r), "json")
    else:
        sys.stdout.write(
            f"pushed {r.checkpoint_id} to {r.reference}: {r.blobs_transferred} blob(s) uploaded "
            f"({output.human_size(r.bytes_transferred)}), {r.blobs_skipped} already there\n"
        )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    r = stream_result(args, "Pull", pb.PullRequest(reference=args.reference, credentials=_credentials(args),
                                                   lazy=args.lazy))
    if args.output == "json":
        output.emit(output.as_dict(r), "json")
    else:
        if sys.stderr.isatty():
            sys.stderr.write(
                f"pulled {r.reference}: {r.blobs_transferred} blob(s) downloaded "
                f"({output.human_size(r.bytes_transferred)}), {r.blobs_skipped} already here\n"
            )
        sys.stdout.write(r.checkpoint_id + "\n")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    out = os.path.abspath(args.output_file)
    with Client.of(args) as c:
        r = c.call("Export", pb.ExportRequest(checkpoint_id=args.id, container=args.container, output_path=out), timeout=args.timeout)
    sys.stdout.write(f"{r.output_path}\n")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.archive)
    with Client.of(args) as c:
        info = c.call("Import", pb.ImportRequest(input_path=path, namespace=args.namespace or "", name=args.name or ""), timeout=args.timeout)
    if args.output == "json":
        output.emit(output.checkpoint_dict(info), "json")
    else:
        sys.stdout.write(info.id + "\n")
    return 0


def _registry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--username", help=f"registry user (env {ENV_USER})")
    p.add_argument("--password-stdin", action="store_true", help=f"read the password from stdin (or env {ENV_PASSWORD})")
    p.add_argument("--ca-file", help="PEM CA bundle to trust for the registry")
    p.add_argument("--plain-http", action="store_true", help="plain HTTP (for a registry on loopback)")
    p.add_argument("--insecure-skip-verify", action="store_true", help="don't verify the registry's certificate")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("push", parents=[common], help="push a checkpoint to an OCI registry")
    p.add_argument("id", help="checkpoint ID or unique prefix")
    p.add_argument("reference", metavar="REGISTRY/REPO:TAG")
    _registry_flags(p)
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", parents=[common], help="pull a checkpoint from an OCI registry into the store")
    p.add_argument("reference", metavar="REGISTRY/REPO:TAG|REGISTRY/REPO@sha256:...")
    p.add_argument("--lazy", action="store_true",
                   help="leave the memory images in the registry; a lazy restore fetches their pages on demand")
    _registry_flags(p)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("export", parents=[common], help="write one container of a checkpoint as a CRI-O/Podman archive")
    p.add_argument("id", help="checkpoint ID or unique prefix")
    p.add_argument("--container", required=True, metavar="NAME")
    p.add_argument("-o", "--output-file", required=True, metavar="FILE.tar")
    p.add_argument("--timeout", type=float, default=600)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", parents=[common], help="take a checkpoint archive (node-agent, CRI-O, Podman) into the store")
    p.add_argument("archive", metavar="FILE.tar")
    p.add_argument("--namespace", help="pod namespace for archives that carry none")
    p.add_argument("--name", help="pod name for archives that carry none")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("-o", "--output", choices=["id", "json"], default="id")
    p.set_defaults(func=cmd_import)
