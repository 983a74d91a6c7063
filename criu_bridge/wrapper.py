"""The OCI runtime wrapper behind the restore runtime handler.

containerd's runc shim runs this instead of runc for every call on
containers of the restore handler. For a container that has a restore plan
(written by the agent under the plans directory, keyed by container ID):

* ``create`` applies the checkpoint's writable-layer diff to the new rootfs,
  then runs ``runc restore --detach`` with the same global flags, bundle,
  pid file and stdio, so the restored process keeps writing into the new CRI
  log pipes;
* ``start`` is a no-op once the restore succeeded;
* ``delete`` passes through, then removes the plan.

Every other call, and every container without a plan, goes straight to runc
(exec, no extra work). Errors go to runc's JSON log, where the shim picks up
the last one, never to stderr (that is the container's own stderr pipe).
Standard library only, and imported lazily: containerd runs this a lot.
"""

from __future__ import annotations

import os
import sys

PLAN_FILE = "plan.json"
RESTORED = "restored"
FAILED = "failed"

# runc global flags that take a value.
_VALUE_FLAGS = {"--root", "--log", "--log-format", "--criu", "--rootless"}
# `create` flags that take a value, and whether `restore` knows them.
_CREATE_VALUE_FLAGS = {"--bundle", "-b", "--pid-file", "--console-socket", "--preserve-fds"}
_RESTORE_KNOWS = {"--bundle", "-b", "--pid-file", "--console-socket", "--no-pivot"}
# Restore options a plan may ask for, as runc flags.
PLAN_FLAGS = {
    "tcp-established": "--tcp-established",
    "file-locks": "--file-locks",
    "ext-unix-sk": "--ext-unix-sk",
    "shell-job": "--shell-job",
}


class Call:
    """A parsed runc command line: global args, sub-command, its args, the ID."""

    def __init__(self, argv: list[str]) -> None:
        self.global_args: list[str] = []
        self.command = ""
        self.args: list[str] = []
        i = 0
        while i < len(argv):
            a = argv[i]
            if not a.startswith("-"):
                self.command = a
                self.args = argv[i + 1 :]
                break
            self.global_args.append(a)
            if a in _VALUE_FLAGS and "=" not in a:
                i += 1
                if i < len(argv):
                    self.global_args.append(argv[i])
            i += 1
        positional = [x for x in self._positional(self.args)]
        self.container_id = positional[0] if positional else ""

    @staticmethod
    def _positional(args: list[str]) -> list[str]:
        out = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            if a.startswith("-"):
                if a in _CREATE_VALUE_FLAGS and "=" not in a:
                    skip = True
                continue
            out.append(a)
        return out

    def global_value(self, flag: str) -> str | None:
        for i, a in enumerate(self.global_args):
            if a == flag and i + 1 < len(self.global_args):
                return self.global_args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    def option(self, *names: str) -> str | None:
        for i, a in enumerate(self.args):
            for n in names:
                if a == n and i + 1 < len(self.args):
                    return self.args[i + 1]
                if a.startswith(n + "="):
                    return a.split("=", 1)[1]
        return None


def _valid_id(cid: str) -> bool:
    return 0 < len(cid) <= 128 and all(c.isalnum() or c in "-_." for c in cid) and not cid.startswith(".")


def log_error(call: Call, msg: str) -> None:
    """Append an error where the shim looks for the runtime's last error."""
    from criu_bridge.logs import format_runc_log_line

    path = call.global_value("--log")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(format_runc_log_line("error", msg))
    except OSError:
        pass


def restore(runc: str, call: Call, plan_dir: str) -> int:
    import json
    import subprocess

    from criu_bridge import logs, rootfs
    from criu_bridge.errors import BridgeError

    with open(os.path.join(plan_dir, PLAN_FILE), encoding="utf-8") as fh:
        plan = json.load(fh)
    where = f"pod {plan.get('pod', '?')}, container {plan.get('container', '?')}"
    bundle = call.option("--bundle", "-b") or os.getcwd()
    try:
        with open(os.path.join(bundle, "config.json"), encoding="utf-8") as fh:
            spec = json.load(fh)
        root = spec.get("root", {}).get("path", "rootfs")
        root = root if os.path.isabs(root) else os.path.join(bundle, root)
        diff = os.path.join(plan_dir, "rootfs-diff.tar")
        deleted = os.path.join(plan_dir, "deleted.files")
        rootfs.apply_diff(
            root,
            diff if os.path.exists(diff) else None,
            deleted if os.path.exists(deleted) else None,
        )
    except (OSError, ValueError, BridgeError) as exc:
        msg = f"restore of {where}, phase rootfs: {exc}"
        log_error(call, msg)
        _mark(plan_dir, FAILED, msg)
        return 1

    work = os.path.join(plan_dir, "work")
    os.makedirs(work, exist_ok=True)
    lazy = plan.get("lazy") is True
    if lazy:
        problem = _lazy_problem(plan_dir, work)
        if problem:
            msg = f"restore of {where}, phase lazy-pages: {problem}"
            log_error(call, msg)
            _mark(plan_dir, FAILED, msg)
            return 1
    # Lazily, the memory comes from the agent's lazy-pages daemon, which
    # waits on work/lazy-pages.socket. Otherwise --auto-dedup: CRIU punches
    # out each page of our private image copy as it restores it, so the
    # copy's page cache is handed back while the process's memory fills
    # (restores of large images no longer run short of warm pages).
    argv = [runc, *call.global_args, "restore", "--detach", "--lazy-pages" if lazy else "--auto-dedup",
            "--image-path", os.path.join(plan_dir, "images"), "--work-path", work]
    skip = False
    for i, a in enumerate(call.args):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in _CREATE_VALUE_FLAGS and "=" not in a:
            skip = True
            if name in _RESTORE_KNOWS and i + 1 < len(call.args):
                argv += [a, call.args[i + 1]]
            continue
        if a.startswith("-"):
            if name in _RESTORE_KNOWS:
                argv.append(a)
            continue
    for opt in plan.get("options", []):
        if opt in PLAN_FLAGS:
            argv.append(PLAN_FLAGS[opt])
    argv.append(call.container_id)
    rc = subprocess.run(argv, close_fds=True).returncode
    if rc != 0:
        decisive = logs.read_decisive(os.path.join(work, "restore.log"))
        msg = f"restore of {where}, phase restore: " + ("; ".join(decisive) or f"runc restore exited {rc}")
        msg += f" (full CRIU log: {os.path.join(work, 'restore.log')})"
        log_error(call, msg)
        _mark(plan_dir, FAILED, msg)
        return rc or 1
    _mark(plan_dir, RESTORED, "")
    if lazy:
        return 0  # the images are the daemon's until every page is in
    # The images served their purpose; keep only the logs.
    import shutil

    shutil.rmtree(os.path.join(plan_dir, "images"), ignore_errors=True)
    shutil.rmtree(os.path.join(plan_dir, "predump"), ignore_errors=True)
    return 0


def _lazy_problem(plan_dir: str, work: str) -> str:
    """Why a lazy restore cannot start now ("" when it can)."""
    try:
        with open(os.path.join(plan_dir, "lazy.failed"), encoding="utf-8") as fh:
            return fh.read(4096).strip() or "the page source failed"
    except OSError:
        pass
    if not os.path.exists(os.path.join(work, "lazy-pages.socket")):
        return ("the page source for this container is gone (it waits a limited time for StartContainer); "
                "restore the checkpoint again")
    return ""


def _mark(plan_dir: str, name: str, text: str) -> None:
    try:
        with open(os.path.join(plan_dir, name), "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError:
        pass


def main(runc: str, plans_dir: str, argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    call = Call(args)
    cid = call.container_id
    plan_dir = os.path.join(plans_dir, cid) if _valid_id(cid) else ""
    has_plan = bool(plan_dir) and os.path.exists(os.path.join(plan_dir, PLAN_FILE))
    if not has_plan or call.command not in ("create", "start", "delete"):
        os.execv(runc, [runc, *args])
    if call.command == "create":
        return restore(runc, call, plan_dir)
    if call.command == "start":
        if os.path.exists(os.path.join(plan_dir, RESTORED)):
            return 0
        os.execv(runc, [runc, *args])
    # delete
    import shutil
    import subprocess

    rc = subprocess.run([runc, *args], close_fds=True).returncode
    shutil.rmtree(plan_dir, ignore_errors=True)
    return rc


LAUNCHER = """#!{python} -I
# The restore runtime handler's OCI runtime: generated by node-agent, do not edit.
import sys
from criu_bridge.wrapper import main
sys.exit(main({runc!r}, {plans!r}))
"""


def install(path: str, *, python: str, runc: str, plans_dir: str) -> bool:
    """Write the launcher at `path` (atomically); True if it changed."""
    text = LAUNCHER.format(python=python, runc=runc, plans=plans_dir)
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return False
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return True
