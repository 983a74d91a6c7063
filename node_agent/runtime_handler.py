"""The restore runtime handler as containerd runs it, and whether it serves this agent.

A restore is real only if the runtime that starts its containers is this
agent's wrapper, reading this agent's restore plans. Three layers make sure:

1. before a restore makes its sandbox (`require`): containerd's own account
   of the handler (CRI ``Status`` with ``verbose``: the handler's runc
   options and its ``container_annotations``, however its config file is
   written) names a ``BinaryName`` that is a node-agent launcher serving
   this agent's plans directory, and passes the plan annotation through;
2. after each StartContainer of a container with a plan
   (`verify_restored`): the wrapper recorded that it restored that
   container from that plan, and the PID CRIU restored is the container's
   PID as CRI reports it. Otherwise the container is stopped and the call
   fails;
3. the wrapper refuses to ``create`` a container that carries the plan
   annotation but has no plan (`criu_bridge.wrapper`), whoever calls
   StartContainer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping

from criu_bridge.wrapper import FAILED, GATE_KILLED, PLAN_ANNOTATION, PLAN_FILE, RESTORED, drop_data, launcher_settings
from node_agent import errors
from node_agent.config.schema import Settings
from node_agent.cri import CriClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandlerView:
    """What containerd reports of one runtime handler, and what its binary serves."""

    name: str
    binary: str = ""
    root: str = ""
    container_annotations: tuple[str, ...] = ()
    serves: str = ""  # the plans directory of the launcher at `binary` ("" if it is none)
    found: bool = True

    def problems(self, s: Settings) -> list[str]:
        if not self.found:
            return [f"containerd has no runtime handler {self.name!r}"]
        out = []
        if not self.binary:
            out.append(f"runtime handler {self.name!r} sets no options.BinaryName, so it runs plain runc")
        elif not self.serves:
            out.append(f"runtime handler {self.name!r} runs {self.binary}, which is not a node-agent launcher")
        elif os.path.realpath(self.serves) != os.path.realpath(s.plans_dir):
            out.append(f"runtime handler {self.name!r} runs {self.binary}, which serves restore plans from "
                       f"{self.serves}, but this agent writes them to {s.plans_dir}")
        if not any(annotation_matches(p, PLAN_ANNOTATION) for p in self.container_annotations):
            out.append(f"runtime handler {self.name!r} does not pass the annotation {PLAN_ANNOTATION} to its "
                       "runtime (container_annotations), so its wrapper cannot refuse to start a restored "
                       "container fresh")
        return out


def fix_command(s: Settings) -> str:
    """The command that writes a handler serving this agent."""
    if s.config_file:
        args = ["node-agent", "containerd-config", "--config", s.config_file]
    else:
        args = ["node-agent", "containerd-config", "--store", s.store, "--runc-root", s.runc_root]
    if s.runtime_handler != "criu":
        args += ["--runtime-handler", s.runtime_handler]
    return (f"`{shlex.join(args)}` (or `node-agent install-handler` with the same settings), put its tables in "
            "containerd's config in place of the old ones, and restart containerd")


def annotation_matches(pattern: str, key: str) -> bool:
    """containerd's match of a `container_annotations` entry (Go's path.Match: `*` and `?` stop at `/`)."""
    rx = "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, key) is not None


def _runtimes(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The handler table of containerd's CRI config as `Status` reports it (1.x and 2.x)."""
    for top in (config, *(v for v in config.values() if isinstance(v, Mapping))):
        # the CRI config itself, or a layout that nests it one level deeper
        c = top.get("containerd")
        runtimes = c.get("runtimes") if isinstance(c, Mapping) else None
        if isinstance(runtimes, Mapping):
            return runtimes
    return {}


def view_from_status(info: Mapping[str, str], name: str) -> HandlerView:
    """The handler `name` in a verbose CRI Status `info` map."""
    raw = info.get("config")
    if not raw:
        raise errors.FailedPrecondition("the CRI runtime's verbose Status reports no config: it is not containerd, "
                                        "or too old to check the restore handler")
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise errors.FailedPrecondition(f"the CRI runtime's verbose Status config is not JSON: {exc}") from exc
    rt = _runtimes(config if isinstance(config, Mapping) else {}).get(name)
    if not isinstance(rt, Mapping):
        return HandlerView(name, found=False)
    raw_opts = rt.get("options")
    opts: Mapping[str, Any] = raw_opts if isinstance(raw_opts, Mapping) else {}
    ann = rt.get("ContainerAnnotations") or rt.get("container_annotations") or []
    binary = str(opts.get("BinaryName") or opts.get("binary_name") or "")
    settings = launcher_settings(binary) if binary else None
    return HandlerView(
        name=name, binary=binary, root=str(opts.get("Root") or ""),
        container_annotations=tuple(str(a) for a in ann) if isinstance(ann, list) else (),
        serves=settings[1] if settings else "",
    )


async def inspect(cri: CriClient, name: str) -> HandlerView:
    return view_from_status(await cri.status_info(), name)


async def require(cri: CriClient, s: Settings, name: str, where: str) -> HandlerView:
    """FAILED_PRECONDITION unless handler `name` serves this agent (before anything is made)."""
    view = await inspect(cri, name)
    problems = view.problems(s)
    if problems:
        raise errors.FailedPrecondition(
            f"{where + ': ' if where else ''}{'; '.join(problems)}; a container started by it would run its image's "
            "command from the "
            f"beginning, not the checkpoint; fix: {fix_command(s)}"
        )
    return view


# ---- after StartContainer -------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    """The wrapper's record of one restore (`criu_bridge.wrapper.RESTORED`)."""

    container_id: str
    checkpoint: str
    nonce: str
    pid: int
    extra: Mapping[str, Any] = field(default_factory=dict)


def read_restored(plan_dir: str) -> Restored | None:
    try:
        with open(os.path.join(plan_dir, RESTORED), encoding="utf-8") as fh:
            doc = json.loads(fh.read(8192) or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    try:
        return Restored(str(doc.get("container_id", "")), str(doc.get("checkpoint", "")),
                        str(doc.get("nonce", "")), int(doc.get("pid") or 0))
    except (TypeError, ValueError):
        return None


def refusal(plan_dir: str) -> errors.AgentError | None:
    """The wrapper's own account of a restore it did not do (its `failed` mark), as an error; None without one.

    Its words name the pod, the container and the phase, without the
    runtime's layers around them. A refusal before runc ran (the images'
    privileges, file locks, the plan, the writable layer, the page source)
    is FAILED_PRECONDITION. What failed after runc ran is INTERNAL: CRIU's
    own failure (phase restore), and a filled restore that its pre-resume
    gate stopped, whose cause the page source, not the gate, can tell (a
    failure closes the gate's socket; a gate that comes later finds no one).
    """
    try:
        with open(os.path.join(plan_dir, FAILED), encoding="utf-8", errors="replace") as fh:
            text = fh.read(64 << 10).strip()
    except OSError:
        return None
    if not text:
        return None
    after_runc = ", phase restore: " in text or GATE_KILLED in text
    code: type[errors.AgentError] = errors.Internal if after_runc else errors.FailedPrecondition
    return code(text)


def gate_stopped(refused: errors.AgentError) -> bool:
    """Whether the wrapper's account (`refusal`) is of a filled restore its pre-resume gate stopped."""
    return GATE_KILLED in str(refused)


def plan_nonce(plan_dir: str) -> str | None:
    """The nonce of the plan in `plan_dir` (None when there is no plan)."""
    try:
        with open(os.path.join(plan_dir, PLAN_FILE), encoding="utf-8") as fh:
            doc = json.loads(fh.read(1 << 20))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""
    return str(doc.get("nonce") or "") if isinstance(doc, dict) else ""


def drop_plan_data(plan_dir: str) -> None:
    """Remove a started container's checkpoint data from its plan, keeping the plan and the restore record.

    A lazy restore's images are its page source's to remove when its pages are in.
    """
    try:
        with open(os.path.join(plan_dir, PLAN_FILE), encoding="utf-8") as fh:
            lazy = json.loads(fh.read(1 << 20)).get("lazy") is True
    except (OSError, ValueError, AttributeError):
        return
    if lazy:
        return
    drop_data(plan_dir)


async def verify_restored(cri: CriClient, s: Settings, container_id: str, plan_dir: str, nonce: str, *,
                          where: str, handler: str) -> None:
    """After StartContainer: the container runs the process CRIU restored from this plan, or it is stopped."""
    record = read_restored(plan_dir)
    problem = ""
    if record is None:
        try:
            diagnosis = "; ".join((await inspect(cri, handler)).problems(s))
        except errors.AgentError as exc:
            diagnosis = f"runtime handler {handler!r} cannot be checked ({exc})"
        problem = (f"the runtime started the container without reading its restore plan {plan_dir}, so it runs its "
                   f"image's command from the beginning: {diagnosis or 'the handler now looks right; was it changed?'}"
                   f"; fix: {fix_command(s)}")
        code: type[errors.AgentError] = errors.FailedPrecondition
    else:
        code = errors.Internal
        if record.container_id != container_id or (nonce and record.nonce != nonce):
            problem = f"the wrapper's restore record in {plan_dir} is for another container or plan"
        else:
            try:
                status = await cri.container_status(container_id)
            except errors.AgentError as exc:
                status, problem = None, f"cannot read its status after the restore: {exc}"
            if status is not None and (record.pid <= 0 or status.pid != record.pid):
                problem = (f"its process (PID {status.pid}) is not the one CRIU restored (PID {record.pid}); "
                           "it did not come from the checkpoint")
    if not problem:
        drop_plan_data(plan_dir)
        return
    log.error("%s: %s; stopping it", where, problem, extra={"phase": "verify-start"})
    try:
        await cri.stop_container(container_id, timeout=0)
    except errors.AgentError as exc:
        log.error("%s: cannot stop it: %s", where, exc)
    raise code(f"{where}, phase verify-start: {problem}; the container was stopped")
