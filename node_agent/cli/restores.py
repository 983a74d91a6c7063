"""`restores`: the containers restored on this node and how each is doing, through the daemon."""

from __future__ import annotations

import argparse
from typing import Any

from node_agent.cli import output
from node_agent.cli.client import Client, pb


def _pages(r: dict[str, Any]) -> str:
    done, total = int(r.get("pages_in", 0)), int(r.get("pages_total", 0))
    return f"{done}/{total}" if total else "-"


def _state(r: dict[str, Any]) -> str:
    return f"failed: {r['reason']}" if r["state"] == "failed" and r.get("reason") else str(r["state"])


def cmd_restores(args: argparse.Namespace) -> int:
    with Client.of(args) as c:
        resp = c.call("ListRestores", pb.ListRestoresRequest(pod_namespace=args.namespace or ""))
    items = [output.as_dict(r) for r in resp.restores]
    for r in items:
        for key in ("pages_in", "pages_total"):
            r[key] = int(r.get(key, 0))
    if args.output in output.DATA:
        output.emit(items, args.output)
        return 0
    rows = [
        [f"{r['pod_namespace']}/{r['pod_name']}", r["container"], r["container_id"][:13], r["checkpoint_id"][:19],
         "lazy" if r["lazy"] else "full", _pages(r), _state(r)]
        for r in items
    ]
    output.table(rows, ["POD", "CONTAINER", "CONTAINER ID", "CHECKPOINT", "RESTORE", "PAGES", "STATE"])
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("restores", parents=[common],
                       help="list the containers restored on this node: paging in, done, running, or failed and why")
    p.add_argument("--namespace", help="only this pod namespace")
    output.add_flag(p, "table")
    p.set_defaults(func=cmd_restores)
