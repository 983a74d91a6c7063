"""push, pull, export and import: checkpoints in and out of the node's store."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import Any

from node_agent.cli import output
from node_agent.cli.checkpoints import stream_result
from node_agent.cli.client import CliError, Client, pb

ENV_USER = "NODE_AGENT_REGISTRY_USERNAME"
ENV_PASSWORD = "NODE_AGENT_REGISTRY_PASSWORD"


def _credentials(args: argparse.Namespace) -> Any:
    password = os.environ.get(ENV_PASSWORD, "")
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    username = args.username or os.environ.get(ENV_USER, "")
    if username and not password and sys.stdin.isatty():
        password = getpass.getpass(f"password for {username}: ")
    ca = ""
    if args.ca_file:
        # Read here, with the caller's permissions: the daemon opens no path the caller names.
        try:
            with open(args.ca_file, encoding="utf-8", errors="replace") as fh:
                ca = fh.read(1 << 20)
        except OSError as exc:
            raise CliError(f"--ca-file {args.ca_file}: {exc.strerror}", 2) from None
    return pb.RegistryCredentials(
        username=username, password=password, ca_pem=ca,
        plain_http=args.plain_http, insecure_skip_verify=args.insecure_skip_verify,
    )


def cmd_push(args: argparse.Namespace) -> int:
    r = stream_result(args, "Push", pb.PushRequest(checkpoint_id=args.id, reference=args.reference, credentials=_credentials(args)))
    if args.output in output.DATA:
        output.emit(output.as_dict(r), args.output)
    else:
        sys.stdout.write(
            f"pushed {r.checkpoint_id} to {r.reference}: {r.blobs_transferred} blob(s) uploaded "
            f"({output.human_size(r.bytes_transferred)}), {r.blobs_skipped} already there\n"
        )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    r = stream_result(args, "Pull", pb.PullRequest(reference=args.reference, credentials=_credentials(args),
                                                   lazy=args.lazy))
    if args.output in output.DATA:
        output.emit(output.as_dict(r), args.output)
    else:
        if sys.stderr.isatty():
            sys.stderr.write(
                f"pulled {r.reference}: {r.blobs_transferred} blob(s) downloaded "
                f"({output.human_size(r.bytes_transferred)}), {r.blobs_skipped} already here\n"
            )
        sys.stdout.write(r.checkpoint_id + "\n")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """The archive comes through the socket; this process writes it, with the caller's own permissions."""
    from node_agent.interop.exporting import compression_for

    out = os.path.abspath(args.file)
    directory, base = os.path.split(out)
    if os.path.lexists(out):
        raise CliError(f"{out} exists", 1)
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror}", 1) from None
    done = False
    try:
        with os.fdopen(fd, "wb") as fh, Client.of(args) as c:
            req = pb.ExportRequest(checkpoint_id=args.id, container=args.container, compression=compression_for(out),
                                   plaintext=args.plaintext)
            for chunk in c.stream("ExportArchive", req, timeout=args.timeout):
                fh.write(chunk.data)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, out)  # never over a file that appeared meanwhile
        done = True
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror}", 1) from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    if done:
        sys.stdout.write(f"{out}\n")
    return 0


def _archive_chunks(fh: Any, header: Any) -> Any:
    yield pb.ImportChunk(header=header)
    while True:
        data = fh.read(1 << 20)
        if not data:
            return
        yield pb.ImportChunk(data=data)


def cmd_import(args: argparse.Namespace) -> int:
    """This process reads the archive, with the caller's own permissions, and streams it through the socket."""
    path = os.path.abspath(args.archive)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}", 1) from None
    header = pb.ImportRequest(namespace=args.namespace or "", name=args.name or "")
    with fh, Client.of(args) as c:
        info = c.call("ImportArchive", _archive_chunks(fh, header), timeout=args.timeout)
    if args.output in output.DATA:
        output.emit(output.checkpoint_dict(info), args.output)
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


class _DeprecatedFile(argparse.Action):
    """`export -o FILE`: still the archive's path, with a warning to use --file."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stderr.write(f"node-agent: warning: export {option_string} FILE is deprecated and goes in the next "
                         "release; use --file FILE\n")
        setattr(namespace, self.dest, values)


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("push", parents=[common], help="push a checkpoint to an OCI registry")
    p.add_argument("id", help="checkpoint ID or unique prefix")
    p.add_argument("reference", metavar="REGISTRY/REPO:TAG")
    _registry_flags(p)
    output.add_flag(p, "table")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", parents=[common], help="pull a checkpoint from an OCI registry into the store")
    p.add_argument("reference", metavar="REGISTRY/REPO:TAG|REGISTRY/REPO@sha256:...")
    p.add_argument("--lazy", action="store_true",
                   help="leave the memory images in the registry; a lazy restore fetches their pages on demand")
    _registry_flags(p)
    output.add_flag(p, "id")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("export", parents=[common], help="write one container of a checkpoint as a CRI-O/Podman archive")
    p.add_argument("id", help="checkpoint ID or unique prefix")
    p.add_argument("--container", required=True, metavar="NAME")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--file", metavar="FILE.tar", help="the archive to write; .tar.gz and .tar.zst compress it")
    # -o meant this file before it meant the output format everywhere; kept for one release.
    where.add_argument("-o", "--output-file", dest="file", action=_DeprecatedFile, help=argparse.SUPPRESS)
    p.add_argument("--plaintext", action="store_true",
                   help="export an encrypted checkpoint (archives are plaintext: its secrets leave in the clear)")
    p.add_argument("--timeout", type=float, default=600)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", parents=[common], help="take a checkpoint archive (node-agent, CRI-O, Podman) into the store")
    p.add_argument("archive", metavar="FILE.tar")
    p.add_argument("--namespace", help="pod namespace for archives that carry none")
    p.add_argument("--name", help="pod name for archives that carry none")
    p.add_argument("--timeout", type=float, default=600)
    output.add_flag(p, "id")
    p.set_defaults(func=cmd_import)
