"""checkpoint, restore and `checkpoints ls|inspect|rm`: through the daemon."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from node_agent.cli import output
from node_agent.cli.client import Client, CliError, pb


def _parse_options(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not key:
            raise CliError(f"bad --option {p!r}: expected KEY=VALUE", 2)
        out[key] = value if sep else "true"
    return out


class _Progress:
    """Progress lines on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def show(self, p: Any) -> None:
        if not self.tty:
            return
        parts = [p.phase]
        if p.containers_total:
            parts.append(f"{p.containers_done}/{p.containers_total} containers")
        if p.bytes_total:
            parts.append(f"{output.human_size(p.bytes_done)}/{output.human_size(p.bytes_total)}")
        if p.message:
            parts.append(p.message)
        sys.stderr.write("\r\033[K" + "  ".join(parts))
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def stream_result(args: argparse.Namespace, method: str, request: Any) -> Any:
    """Call a streaming method, showing its progress; the final result event."""
    prog = _Progress()
    result = None
    with Client.of(args) as c:
        try:
            for ev in c.stream(method, request, timeout=args.timeout):
                if ev.HasField("progress"):
                    prog.show(ev.progress)
                elif ev.HasField("result"):
                    result = ev.result
        finally:
            prog.end()
    if result is None:
        raise CliError(f"the daemon ended the {method.lower()} without a result")
    return result


def cmd_checkpoint(args: argparse.Namespace) -> int:
    req = pb.CheckpointRequest(pod=args.pod, containers=args.container or [], options=_parse_options(args.option or []))
    result = stream_result(args, "Checkpoint", req)
    if args.output in output.DATA:
        output.emit(output.checkpoint_dict(result), args.output)
    else:
        if sys.stderr.isatty():
            sys.stderr.write(f"pod {result.pod_namespace}/{result.pod_name} frozen for {result.frozen_ms:.0f} ms\n")
        sys.stdout.write(result.id + "\n")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    options = _parse_options(args.option or [])
    if args.lazy is not None:
        options["lazy"] = "true" if args.lazy else "false"
    req = pb.RestoreRequest(
        checkpoint_id=args.checkpoint, namespace=args.namespace or "", name=args.name or "",
        start=args.start, options=options, runtime_handler=args.runtime_handler or "",
    )
    result = stream_result(args, "Restore", req)
    if args.output in output.DATA:
        output.emit(output.as_dict(result), args.output)
    else:
        sys.stdout.write(result.pod_sandbox_id + "\n")
        for rc in result.containers:
            sys.stdout.write(f"{rc.name} {rc.container_id}\n")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with Client.of(args) as c:
        resp = c.call("ListCheckpoints", pb.ListCheckpointsRequest(pod_namespace=args.namespace or ""))
    items = [output.checkpoint_dict(i) for i in resp.checkpoints]
    if args.output in output.DATA:
        output.emit(items, args.output)
        return 0
    rows = [
        [
            i["id"][:19], f"{i['pod_namespace']}/{i['pod_name']}",
            ",".join(c["name"] for c in i.get("containers", [])), i["created"][:19].replace("T", " "),
            "?" if i.get("locked") else output.human_size(i["size"]), f"{i['frozen_ms']:.0f}", _sealed(i),
        ]
        for i in items
    ]
    output.table(rows, ["ID", "POD", "CONTAINERS", "CREATED", "SIZE", "FROZEN_MS", "KEY"])
    return 0


def _sealed(info: dict[str, Any]) -> str:
    """An encrypted checkpoint's key id (and whether that key is missing here), or "-"."""
    kid = str(info.get("key_id") or "")
    return f"{kid} (not configured)" if info.get("locked") else kid or "-"


def cmd_inspect(args: argparse.Namespace) -> int:
    with Client.of(args) as c:
        info = c.call("InspectCheckpoint", pb.InspectCheckpointRequest(checkpoint_id=args.id))
    d = output.checkpoint_dict(info)
    if args.output in output.DATA:
        output.emit(d, args.output)
        return 0
    for key in ("id", "pod_namespace", "pod_name", "pod_uid", "pod_sandbox_id", "created", "node", "criu_version"):
        sys.stdout.write(f"{key + ':':16} {d.get(key, '')}\n")
    sys.stdout.write(f"{'size:':16} {output.human_size(d['size'])} (stored {output.human_size(d['stored_size'])})\n")
    sys.stdout.write(f"{'frozen_ms:':16} {d['frozen_ms']:.1f}\n")
    sys.stdout.write(f"{'encryption:':16} {'key ' + _sealed(d) if d.get('key_id') else 'none'}\n")
    sys.stdout.write(f"{'signed by:':16} {', '.join(d.get('signers') or []) or 'nobody'}\n")
    sys.stdout.write(f"{'options:':16} {', '.join(f'{k}={v}' for k, v in sorted(d.get('options', {}).items())) or '-'}\n")
    sys.stdout.write("containers:\n")
    for c in d.get("containers", []):
        sys.stdout.write(
            f"  {c['name']}: image {c['image']}, {output.human_size(c['size'])}, dump {c['dump_ms']:.0f} ms, log {c['dump_log']}\n"
        )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with Client.of(args) as c:
        resp = c.call("RemoveCheckpoint", pb.RemoveCheckpointRequest(checkpoint_id=args.id))
    if args.output in output.DATA:
        output.emit({"removed": resp.checkpoint_id}, args.output)
    else:
        sys.stdout.write(resp.checkpoint_id + "\n")
    return 0


def cmd_rekey(args: argparse.Namespace) -> int:
    with Client.of(args) as c:
        resp = c.call("RekeyCheckpoint", pb.RekeyCheckpointRequest(checkpoint_id=args.id, replace=args.replace),
                      timeout=args.timeout)
    if args.output in output.DATA:
        output.emit(output.as_dict(resp), args.output)
        return 0
    if resp.checkpoint_id == resp.previous_id:
        sys.stderr.write(f"{resp.previous_id} is sealed under its domain's newest key ({resp.key_id or 'none'}) already\n")
    else:
        sys.stderr.write(f"{resp.previous_id} ({resp.previous_key_id or 'not encrypted'}) -> key "
                         f"{resp.key_id or 'none (its domain has no key)'}"
                         + ("; the old checkpoint is removed\n" if resp.replaced else "; the old checkpoint is kept\n"))
        if resp.signed_by:
            sys.stderr.write(f"the new checkpoint is signed by this node ({resp.signed_by})\n")
        elif resp.unsigned_reason:
            sys.stderr.write(f"the new checkpoint is NOT signed: {resp.unsigned_reason}\n")
    sys.stdout.write(resp.checkpoint_id + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with Client.of(args) as c:
        resp = c.call("VerifyCheckpoint", pb.VerifyCheckpointRequest(checkpoint_id=args.id), timeout=args.timeout)
    if args.output in output.DATA:
        output.emit(output.as_dict(resp), args.output)
    elif resp.ok:
        sys.stdout.write(f"{resp.checkpoint_id}: OK ({resp.blobs_checked} blobs)\n")
    else:
        for b in resp.bad_blobs:
            sys.stdout.write(f"BAD {b.digest}: {b.reason} (used by {', '.join(b.paths) or '-'})\n")
    if not resp.ok:
        raise CliError(f"{resp.checkpoint_id}: {len(resp.bad_blobs)} bad blob(s) out of {resp.blobs_checked}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    with Client.of(args) as c:
        resp = c.call("GarbageCollect", pb.GarbageCollectRequest(dry_run=args.dry_run), timeout=600)
    if args.output in output.DATA:
        output.emit(output.as_dict(resp), args.output)
        return 0
    verb = "would remove" if resp.dry_run else "removed"
    for cid in resp.removed_checkpoints:
        sys.stdout.write(f"{verb} {cid}\n")
    sys.stdout.write(
        f"{verb} {len(resp.removed_checkpoints)} checkpoint(s) and {resp.removed_blobs} blob(s), "
        f"{output.human_size(resp.bytes_freed)}; {resp.kept} checkpoint(s) kept\n"
    )
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("checkpoint", parents=[common], help="checkpoint a running pod")
    p.add_argument("pod", help="sandbox ID, unique ID prefix, or NAMESPACE/NAME")
    p.add_argument("--container", action="append", metavar="NAME", help="only this container (repeatable)")
    p.add_argument("--option", action="append", metavar="K=V", help="checkpoint option, e.g. tcp-established=true")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="deadline for the whole checkpoint")
    output.add_flag(p, "id")
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("restore", parents=[common], help="restore a checkpoint as a new pod")
    p.add_argument("checkpoint", help="checkpoint ID (sha256:<hex>) or a unique prefix")
    p.add_argument("--namespace", help="target namespace (default: the checkpoint's)")
    p.add_argument("--name", help="target pod name (default: <name>-restored-<6 hex>)")
    p.add_argument("--start", action="store_true", help="also start the restored containers")
    lazy = p.add_mutually_exclusive_group()
    lazy.add_argument("--lazy", dest="lazy", action="store_true", default=None,
                      help="start the containers before their memory is read; pages stream in from the store "
                           "(the default where supported, see lazy-restore)")
    lazy.add_argument("--full", dest="lazy", action="store_false",
                      help="read all memory before the containers start")
    p.add_argument("--option", action="append", metavar="K=V", help="restore option")
    p.add_argument("--runtime-handler", help="runtime handler for the new sandbox")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS")
    output.add_flag(p, "id")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("checkpoints", help="list, inspect and remove stored checkpoints")
    csub = p.add_subparsers(dest="checkpoints_cmd", required=True)
    q = csub.add_parser("ls", parents=[common], help="list checkpoints")
    q.add_argument("--namespace", help="only this pod namespace")
    output.add_flag(q, "table")
    q.set_defaults(func=cmd_ls)
    q = csub.add_parser("inspect", parents=[common], help="show one checkpoint")
    q.add_argument("id")
    output.add_flag(q, "table")
    q.set_defaults(func=cmd_inspect)
    q = csub.add_parser("verify", parents=[common], help="check every blob of a checkpoint; name the bad ones")
    q.add_argument("id")
    q.add_argument("--timeout", type=float, default=600)
    output.add_flag(q, "table")
    q.set_defaults(func=cmd_verify)
    q = csub.add_parser("rekey", parents=[common],
                        help="re-encrypt a checkpoint under its key domain's newest key, as a new checkpoint")
    q.add_argument("id")
    q.add_argument("--replace", action="store_true", help="remove the old checkpoint once the new one is published")
    q.add_argument("--timeout", type=float, default=600)
    output.add_flag(q, "id")
    q.set_defaults(func=cmd_rekey)
    q = csub.add_parser("rm", parents=[common], help="remove one checkpoint")
    q.add_argument("id")
    output.add_flag(q, "table")
    q.set_defaults(func=cmd_rm)

    p = sub.add_parser("gc", parents=[common], help="apply the retention policy and remove unreferenced blobs")
    p.add_argument("--dry-run", action="store_true", help="only say what would go")
    output.add_flag(p, "table")
    p.set_defaults(func=cmd_gc)
