"""The OCI runtime wrapper behind the restore runtime handler.

containerd's runc shim runs this instead of runc for every call on
containers of the restore handler. For a container that has a restore plan
(written by the agent under the plans directory, keyed by container ID):

* ``create`` checks that no live process on this host holds a file lock
  the restored processes held too (CRIU would wait for it forever), applies
  the checkpoint's writable-layer diff to the new rootfs, holds what the
  CRIU images would grant the processes (credentials, capabilities,
  seccomp, namespaces, mounts) to the container's own config.json
  (`criu_bridge.privileges`: a checkpoint grants nothing), moves the
  next PID of a PID namespace it joins past every PID the pod's restore
  takes back (`criu_bridge.pidns`), then runs
  ``runc restore --detach`` with the same global flags, bundle, pid file and
  stdio, so the restored process keeps writing into the new CRI log pipes;
  it then records what it did (`RESTORED`: the container, the checkpoint,
  the plan's nonce and the restored init's PID), which the agent checks
  after StartContainer;
* ``start`` is a no-op once the restore succeeded;
* ``delete`` passes through, then removes the plan.

A restored container carries the plan's nonce in its OCI annotations
(`PLAN_ANNOTATION`, passed through by the handler's
``container_annotations``). ``create`` of a container with that mark but
without its plan here (a handler serving another store, a plan removed) is
refused: a restore never starts the image's command from the beginning.

Every other call, and every container without a plan or a mark, goes
straight to runc (exec, no extra work). Errors go to runc's JSON log, where
the shim picks up the last one, never to stderr (that is the container's
own stderr pipe). Standard library only, and imported lazily: containerd
runs this a lot.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # no `typing` import at run time: containerd runs this a lot
if TYPE_CHECKING:
    from typing import Any

PLAN_FILE = "plan.json"
RESTORED = "restored"
FAILED = "failed"
LOCKS_FILE = "locks.json"
# What of a plan is checkpoint data (plaintext): CRIU's images, pre-dumped
# memory, the writable layer's diff and its lists.
PLAN_DATA = ("images", "predump", "rootfs-diff.tar", "deleted.files", "opaque.dirs")
# The OCI annotation a restored container carries: its plan's nonce.
PLAN_ANNOTATION = "node-agent.io/restore-plan"
_MAX_SPEC = 64 << 20

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
# What CRIU is told through a configuration file (work/criu.conf, named by
# $CRIU_CONFIG_FILE, read before runc's request; runc has no flag for it):
# `tcp-close` on every restore that does not ask for `tcp-established`. CRIU
# refuses an image holding any TCP socket with a peer port without one of the
# two, and a dump may hold such a socket without either: one whose peer closed
# it while the container was frozen is dumped in state CLOSE, which needs no
# option to dump, and is not listed in /proc/net/tcp for the agent to see
# (criu_bridge.tcp). With no such socket in the image the option does nothing.
TCP_CLOSE = "tcp-close"
# How the wrapper's account of a filled restore that its pre-resume gate stopped ends: CRIU ran and
# restored the processes, and the gate killed them because the page source did not say every page
# was in. The page source's own account, when it gave one, is the reason (the agent asks it first).
GATE_KILLED = "its processes were killed before they ran"


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


def _bundle(call: Call) -> str:
    return call.option("--bundle", "-b") or os.getcwd()


def _spec(bundle: str) -> dict[str, Any]:
    import json

    with open(os.path.join(bundle, "config.json"), "rb") as fh:
        data = fh.read(_MAX_SPEC + 1)
    if len(data) > _MAX_SPEC:
        raise ValueError(f"{bundle}/config.json is larger than {_MAX_SPEC} bytes")
    spec = json.loads(data)
    if not isinstance(spec, dict):
        raise ValueError(f"{bundle}/config.json is not a JSON object")
    return spec


def marked(bundle: str) -> str | None:
    """The plan nonce a container's OCI spec carries (None: not a restored container)."""
    path = os.path.join(bundle, "config.json")
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_SPEC + 1)
    except OSError:
        return None
    if PLAN_ANNOTATION.encode() not in data:
        return None  # the common case, without parsing the spec
    try:
        spec = _spec(bundle)
    except (OSError, ValueError):
        return ""
    ann = spec.get("annotations")
    value = ann.get(PLAN_ANNOTATION) if isinstance(ann, dict) else None
    return value if isinstance(value, str) else None


def refuse_unplanned(call: Call, plans_dir: str, nonce: str) -> int:
    """`create` of a marked container whose plan is not here: refused, nothing started."""
    msg = (f"container {call.container_id} is a restored container (annotation {PLAN_ANNOTATION}={nonce[:16]}) "
           f"but this runtime (plans directory {plans_dir}) has no restore plan for it; refusing to start it "
           "from its image. The handler's wrapper must serve the agent's store: run `node-agent containerd-config` "
           "with the agent's own settings, then restart containerd, and restore again")
    log_error(call, msg)
    return 1


def restore(runc: str, call: Call, plan_dir: str) -> int:
    import json
    import subprocess

    from criu_bridge import locks, logs, pidns, privileges, resumegate, taskimages
    from criu_bridge.errors import BridgeError
    from criu_bridge.rootfs.apply import apply_diff

    with open(os.path.join(plan_dir, PLAN_FILE), encoding="utf-8") as fh:
        plan = json.load(fh)
    where = f"pod {plan.get('pod', '?')}, container {plan.get('container', '?')}"
    bundle = _bundle(call)
    nonce = str(plan.get("nonce") or "")
    mark = marked(bundle)
    if mark is not None and nonce and mark != nonce:
        msg = (f"restore of {where}, phase plan: the container's annotation {PLAN_ANNOTATION} names another "
               f"restore plan than {os.path.join(plan_dir, PLAN_FILE)}; refusing to restore it")
        _fail(call, plan_dir, msg)
        return 1
    try:
        held = []
        if os.path.exists(os.path.join(plan_dir, LOCKS_FILE)):
            with open(os.path.join(plan_dir, LOCKS_FILE), encoding="utf-8") as fh:
                held = locks.conflicts(locks.check_entries(json.loads(fh.read(4 << 20))))
    except (OSError, ValueError) as exc:
        held = [f"unreadable {LOCKS_FILE}: {exc}"]
    if held:
        msg = f"restore of {where}, phase file-locks: " + "; ".join(held)
        _fail(call, plan_dir, msg)
        return 1
    try:
        spec = _spec(bundle)
        root = spec.get("root", {}).get("path", "rootfs")
        root = root if os.path.isabs(root) else os.path.join(bundle, root)
        diff = os.path.join(plan_dir, "rootfs-diff.tar")
        deleted = os.path.join(plan_dir, "deleted.files")
        apply_diff(
            root,
            diff if os.path.exists(diff) else None,
            deleted if os.path.exists(deleted) else None,
        )
    except (OSError, ValueError, BridgeError) as exc:
        msg = f"restore of {where}, phase rootfs: {exc}"
        _fail(call, plan_dir, msg)
        return 1
    # What CRIU would give the processes (credentials, seccomp, namespaces,
    # mounts) comes from the images: held to this container's config first.
    try:
        granted = privileges.findings(taskimages.read(os.path.join(plan_dir, "images")), spec,
                                      exists=privileges.path_exists(root))
    except (OSError, BridgeError) as exc:
        granted = [f"the images cannot be read: {exc}"]
    if granted:
        msg = (f"restore of {where}, phase privileges: the checkpoint's images grant what this container's "
               f"config does not: {'; '.join(granted)}; refusing to restore it")
        _fail(call, plan_dir, msg)
        return 1
    # Joining the pod's PID namespace: what runs in it from now on gets PIDs above every one the
    # checkpoint's containers take back (criu_bridge.pidns).
    shared, floor = pidns.joined(spec), plan.get("pid_floor")
    if shared and isinstance(floor, int) and not isinstance(floor, bool) and floor > 0:
        try:
            pidns.advance(shared, floor)
        except OSError as exc:
            _fail(call, plan_dir, f"restore of {where}, phase pid-namespace: {shared}: {exc}")
            return 1

    work = os.path.join(plan_dir, "work")
    os.makedirs(work, exist_ok=True)
    lazy = plan.get("lazy") is True
    if lazy:
        problem = _lazy_problem(plan_dir, work)
        if not problem and plan.get("memory_at_start") is True:
            # The plan holds no memory until now: the agent writes what CRIU places itself.
            verdict = resumegate.ask(os.path.join(work, resumegate.MEMORY_SOCKET_NAME),
                                     "the agent ended the restore before it wrote the memory CRIU places itself",
                                     "the agent that holds this container's memory until it starts")
            problem = "" if verdict == "ok" else verdict
        if problem:
            msg = f"restore of {where}, phase lazy-pages: {problem}"
            _fail(call, plan_dir, msg)
            return 1
    # Lazily, the memory comes from the agent's page source, which waits
    # on work/lazy-pages.socket for CRIU to hand it the userfaultfds. Otherwise --auto-dedup: CRIU punches
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
    pid_file = call.option("--pid-file")
    if not pid_file:
        pid_file = os.path.join(work, "init.pid")
        argv += ["--pid-file", pid_file]
    argv.append(call.container_id)
    env = None
    config = [] if "tcp-established" in plan.get("options", []) else [TCP_CLOSE]
    filled = lazy and plan.get("filled") is True
    if filled:
        # A full restore through the page source: CRIU's pre-resume action runs the gate, which holds the
        # processes (stopped, none of their code run) until every page is in (criu_bridge.resumegate).
        gate = os.path.join(work, resumegate.SCRIPT_NAME)
        with open(os.open(gate, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700), "w", encoding="utf-8") as fh:
            fh.write(resumegate.script(sys.executable, work))
        config.append(f"action-script {gate}")
    if config:
        conf = os.path.join(work, "criu.conf")
        with open(conf, "w", encoding="ascii") as fh:
            fh.write("".join(f"{line}\n" for line in config))
        env = dict(os.environ, CRIU_CONFIG_FILE=conf)
    rc = subprocess.run(argv, close_fds=True, env=env).returncode
    gated = _read_text(os.path.join(work, resumegate.FAILED_NAME)) if filled else ""
    if gated and rc == 0:
        # CRIU only logs a pre-resume script's failure and goes on: the gate killed the processes where they
        # stood, and CRIU may still let go of them in time and say the restore finished. None of them ran,
        # and the restore did not happen: the container goes, as after a restore runc saw fail.
        subprocess.run([runc, *call.global_args, "delete", "--force", call.container_id], close_fds=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rc = 1
    if rc != 0:
        decisive = logs.read_decisive(os.path.join(work, "restore.log"))
        if gated:
            msg = f"restore of {where}, phase lazy-pages: {gated}; {GATE_KILLED}"
        else:
            msg = f"restore of {where}, phase restore: " + ("; ".join(decisive) or f"runc restore exited {rc}")
        msg += f" (full CRIU log: {os.path.join(work, 'restore.log')})"
        _fail(call, plan_dir, msg)
        return rc or 1
    try:
        with open(pid_file if os.path.isabs(pid_file) else os.path.join(bundle, pid_file), encoding="ascii") as fh:
            pid = int(fh.read(32).strip())
    except (OSError, ValueError):
        pid = 0
    _mark(plan_dir, RESTORED, json.dumps({"container_id": call.container_id, "checkpoint": plan.get("checkpoint", ""),
                                          "nonce": nonce, "pid": pid}))
    if lazy:
        return 0  # the images are the page source's until every page is in
    drop_data(plan_dir)  # served their purpose; the marks and logs stay
    return 0


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(8192).strip()
    except OSError:
        return ""


def _lazy_problem(plan_dir: str, work: str) -> str:
    """Why a lazy restore cannot start now ("" when it can)."""
    failed = os.path.join(plan_dir, "lazy.failed")
    if os.path.exists(failed):
        return _read_text(failed) or "the page source failed"
    if not os.path.exists(os.path.join(work, "lazy-pages.socket")):
        return ("the page source for this container is gone (it waits a limited time for StartContainer); "
                "restore the checkpoint again")
    return ""


def _fail(call: Call, plan_dir: str, msg: str) -> None:
    """A restore that did not happen: the error where the shim looks, the plan marked, its data gone.

    The plan is never used again (a new restore writes a new one), so the
    plaintext it holds goes now, not when the container is removed: CRIU's
    images and the writable layer. A lazy plan's images are its page
    source's, which ends with the restore.
    """
    log_error(call, msg)
    _mark(plan_dir, FAILED, msg)
    try:
        import json

        with open(os.path.join(plan_dir, PLAN_FILE), encoding="utf-8") as fh:
            lazy = json.loads(fh.read(1 << 20)).get("lazy") is True
    except (OSError, ValueError, AttributeError):
        lazy = False
    if not lazy:
        drop_data(plan_dir)


def drop_data(plan_dir: str) -> None:
    """Remove a plan's checkpoint data (`PLAN_DATA`), keeping the plan, its marks and its logs."""
    import shutil

    for name in PLAN_DATA:
        path = os.path.join(plan_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                pass


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
    if not has_plan and call.command == "create":
        nonce = marked(_bundle(call))
        if nonce is not None:
            return refuse_unplanned(call, plans_dir, nonce)
    if not has_plan or call.command not in ("create", "start", "delete"):
        os.execv(runc, [runc, *args])
    if call.command == "create":
        return restore(runc, call, plan_dir)
    if call.command == "start":
        if os.path.exists(os.path.join(plan_dir, RESTORED)):
            return 0
        os.execv(runc, [runc, *args])
    # delete: the plan goes; a refusal's mark stays for the agent to read (no checkpoint data in it),
    # since the runtime deletes a task that failed to start before its caller hears why.
    import shutil
    import subprocess

    rc = subprocess.run([runc, *args], close_fds=True).returncode
    if os.path.exists(os.path.join(plan_dir, FAILED)):
        for name in os.listdir(plan_dir):
            if name != FAILED:
                path = os.path.join(plan_dir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
    else:
        shutil.rmtree(plan_dir, ignore_errors=True)
    return rc


LAUNCHER = """#!{python} -IS
# The restore runtime handler's OCI runtime: generated by node-agent, do not edit.
import sys
{where}try:
    import criu_bridge
except ImportError:  # installed as a package of that interpreter only
    import site
    site.main()
from criu_bridge.wrapper import main
sys.exit(main({runc!r}, {plans!r}))
"""
"""The launcher runs without the site module (-S): containerd starts it for every runc call of the handler's
containers, and site would first process every .pth file of the interpreter's site-packages (an editable
install's import hook among them). criu_bridge needs nothing but the standard library: it is found where
the agent found it when the launcher runs the agent's own interpreter, beside the standard library (a
runtime bundle), or, for another interpreter, through site after all. Another interpreter is never given
the agent's directory: in a DaemonSet that names a path inside the agent's image, not one on the host."""


def launcher_settings(path: str) -> tuple[str, str] | None:
    """(runc, plans directory) of a launcher written by `install`; None if `path` is not one."""
    import ast
    import re

    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(8192)
    except OSError:
        return None
    if "from criu_bridge.wrapper import main" not in text:
        return None
    m = re.search(r"^sys\.exit\(main\((.*)\)\)\s*$", text, re.M)
    if not m:
        return None
    try:
        args = ast.literal_eval("(" + m.group(1) + ",)")
    except (ValueError, SyntaxError):
        return None
    if len(args) != 2 or not all(isinstance(a, str) for a in args):
        return None
    return args[0], args[1]


def install(path: str, *, python: str, runc: str, plans_dir: str) -> bool:
    """Write the launcher at `path` (atomically); True if it changed."""
    where = ""
    if os.path.realpath(python) == os.path.realpath(sys.executable):  # this interpreter: where it found criu_bridge
        where = f"sys.path.append({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})\n"
    text = LAUNCHER.format(python=python, runc=runc, plans=plans_dir, where=where)
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
