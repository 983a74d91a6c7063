"""The restore handler's OCI runtime wrapper, against a recording fake runc."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from criu_bridge import privileges, resumegate, wrapper
from criu_bridge.wrapper import Call
from tests.unit.criu_images import Checkpoint, core, creds, spec

CID = "a" * 64


def test_call_parsing() -> None:
    c = Call(["--root", "/r", "--log", "/b/log.json", "--log-format", "json", "create", "--bundle", "/b",
              "--pid-file", "/b/init.pid", CID])
    assert c.command == "create" and c.container_id == CID
    assert c.global_value("--log") == "/b/log.json"
    assert c.option("--bundle", "-b") == "/b"
    c = Call(["--root=/r", "delete", "--force", CID])
    assert c.command == "delete" and c.container_id == CID and c.global_value("--root") == "/r"
    assert Call(["--version"]).command == ""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, Path]:
    """A fake runc that records its argv, a bundle with a rootfs, and a launcher."""
    record = tmp_path / "runc-argv.json"
    fake = tmp_path / "runc"
    fake.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {record}\n'
        f'if [ -n "$CRIU_CONFIG_FILE" ]; then cp "$CRIU_CONFIG_FILE" {record}.criu.conf; fi\n'
        'if [ -n "$FAKE_RUNC_FAIL" ]; then\n'
        '  for a in "$@"; do case "$prev" in --work-path) mkdir -p "$a"; echo "(00.1) Error (criu/files-reg.c:1): Can\'t open file vol/held.txt on restore: No such file or directory" > "$a/restore.log";; esac; prev="$a"; done\n'
        "  exit 1\nfi\nexit 0\n"
    )
    fake.chmod(0o755)
    plans = tmp_path / "plans"
    plans.mkdir()
    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / "etc").mkdir(parents=True)
    (bundle / "rootfs" / "etc" / "gone").write_text("x")
    (bundle / "config.json").write_text(json.dumps({**spec(), "root": {"path": "rootfs"}}))
    launcher = tmp_path / "bin" / "node-agent-runc"
    assert wrapper.install(str(launcher), python=sys.executable, runc=str(fake), plans_dir=str(plans))
    assert not wrapper.install(str(launcher), python=sys.executable, runc=str(fake), plans_dir=str(plans))
    return {"record": record, "fake": fake, "plans": plans, "bundle": bundle, "launcher": launcher, "tmp": tmp_path}


def _run(env: dict[str, Path], *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(env["launcher"]), *args], capture_output=True, text=True,
                          env=dict(os.environ, **(extra_env or {})), cwd=str(env["bundle"]))


def _argv(env: dict[str, Path]) -> list[str]:
    return env["record"].read_text().splitlines()


def _plan(env: dict[str, Path]) -> Path:
    d = env["plans"] / CID
    Checkpoint(d / "images").write()
    with tarfile.open(d / "rootfs-diff.tar", "w") as tf:
        data = env["tmp"] / "payload"
        data.write_text("restored content")
        tf.add(str(data), arcname="data/count.log")
    (d / "deleted.files").write_text(json.dumps(["etc/gone"]))
    (d / "plan.json").write_text(json.dumps({"version": 1, "pod": "ns/p", "container": "app",
                                             "options": ["tcp-established"]}))
    return d


def test_containers_without_a_plan_pass_straight_through(env: dict[str, Path]) -> None:
    args = ["--root", "/r", "create", "--bundle", str(env["bundle"]), "--pid-file", "/p", CID]
    assert _run(env, *args).returncode == 0
    assert _argv(env) == args
    assert _run(env, "--root", "/r", "state", CID).returncode == 0
    assert _argv(env) == ["--root", "/r", "state", CID]


def test_the_launcher_starts_without_the_site_module(tmp_path: Path) -> None:
    """containerd runs it for every runc call: the interpreter's .pth files (an editable install's import hook)
    are not processed, and criu_bridge is found where the installing interpreter found it."""
    launcher = tmp_path / "node-agent-runc"
    wrapper.install(str(launcher), python=sys.executable, runc="/bin/true", plans_dir=str(tmp_path))
    text = launcher.read_text()
    assert text.splitlines()[0] == f"#!{sys.executable} -IS"
    assert wrapper.launcher_settings(str(launcher)) == ("/bin/true", str(tmp_path))
    probe = text.replace("sys.exit(main(", "print('site' in sys.modules, main.__module__)\nsys.exit(0 and main(")
    out = subprocess.run([sys.executable, "-IS", "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["False", "criu_bridge.wrapper"]
    # Another interpreter is not given the agent's directory (in a DaemonSet, a path inside the agent's image).
    other = tmp_path / "other-runc"
    wrapper.install(str(other), python="/opt/node-agent/runtime/bin/python3", runc="/bin/true", plans_dir=str(tmp_path))
    assert "sys.path.append" not in other.read_text() and "sys.path.append" in text
    assert wrapper.launcher_settings(str(other)) == ("/bin/true", str(tmp_path))


def test_create_with_a_plan_restores(env: dict[str, Path]) -> None:
    d = _plan(env)
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle", str(env["bundle"]),
             "--pid-file", "/b/init.pid", "--no-new-keyring", CID)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    argv = _argv(env)
    assert argv[:7] == ["--root", "/r", "--log", str(log), "--log-format", "json", "restore"]
    assert "--detach" in argv and "--tcp-established" in argv and "--no-new-keyring" not in argv
    assert argv[argv.index("--image-path") + 1] == str(d / "images")
    assert argv[argv.index("--bundle") + 1] == str(env["bundle"])
    assert argv[argv.index("--pid-file") + 1] == "/b/init.pid"
    assert argv[-1] == CID
    rootfs = env["bundle"] / "rootfs"
    assert (rootfs / "data" / "count.log").read_text() == "restored content"
    assert not (rootfs / "etc" / "gone").exists()
    assert (d / "restored").exists() and not (d / "images").exists()
    # start is then a no-op; delete passes through and removes the plan.
    env["record"].unlink()
    assert _run(env, "--root", "/r", "start", CID).returncode == 0
    assert not env["record"].exists()
    assert _run(env, "--root", "/r", "delete", "--force", CID).returncode == 0
    assert _argv(env) == ["--root", "/r", "delete", "--force", CID]
    assert not d.exists()


def test_images_granting_more_than_the_config_are_refused_before_runc_runs(env: dict[str, Path]) -> None:
    """A checkpoint grants nothing: CAP_SYS_ADMIN in the images, not in config.json, is refused by name."""
    d = _plan(env)
    forged = Checkpoint(d / "images")
    forged.files["core-7.img"] = core(7, comm="sh", thread=creds(
        caps=privileges.capability_mask(["CAP_SYS_ADMIN", "CAP_CHOWN"])))
    forged.write()
    log = env["tmp"] / "log.json"
    r = _run(env, "--log", str(log), "--log-format", "json", "create", "--bundle", str(env["bundle"]), CID)
    assert r.returncode == 1 and r.stderr == ""
    assert not env["record"].exists(), "runc ran"
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert msg.startswith("restore of pod ns/p, container app, phase privileges: ")
    assert ("task 7 (sh): capabilities CAP_SYS_ADMIN in its permitted, effective and bounding sets are outside the "
            "container's bounding set") in msg
    assert (d / "failed").read_text() == msg and not (d / "restored").exists()
    assert not any((d / name).exists() for name in wrapper.PLAN_DATA), "the refused plan keeps its plaintext"
    # containerd deletes the task that failed to start before its caller asks why: the mark stays, alone.
    assert _run(env, "delete", "--force", CID).returncode == 0
    assert sorted(os.listdir(d)) == ["failed"] and (d / "failed").read_text() == msg


def test_unreadable_images_are_refused_as_such(env: dict[str, Path]) -> None:
    d = _plan(env)
    (d / "images" / "pstree.img").write_bytes(b"junk")
    log = env["tmp"] / "log.json"
    r = _run(env, "--log", str(log), "--log-format", "json", "create", "--bundle", str(env["bundle"]), CID)
    assert r.returncode == 1 and not env["record"].exists()
    assert "phase privileges: the checkpoint's images grant what this container's config does not: the images " \
           "cannot be read: pstree.img is truncated" in log.read_text()


@pytest.mark.parametrize("options", [["file-locks"], ["file-locks", "tcp-close"], ["tcp-established"]])
def test_tcp_close_reaches_criu_through_its_configuration_file(env: dict[str, Path], options: list[str]) -> None:
    """Every restore that does not restore connections open restores them closed: a dump can hold a
    socket with a peer port that no /proc table showed (its peer closed it during the freeze)."""
    d = _plan(env)
    (d / "plan.json").write_text(json.dumps({"version": 1, "pod": "ns/p", "container": "app", "options": options}))
    r = _run(env, "--root", "/r", "create", "--bundle", str(env["bundle"]), CID, extra_env={"CRIU_CONFIG_FILE": ""})
    assert r.returncode == 0, r.stderr
    conf = Path(str(env["record"]) + ".criu.conf")
    if "tcp-established" in options:
        assert "--tcp-established" in _argv(env)
        assert not conf.exists()
    else:
        assert "--file-locks" in _argv(env) and not any(a.startswith("--tcp") for a in _argv(env))
        assert conf.read_text() == "tcp-close\n"  # runc has no flag for it; CRIU reads the file first
        assert (d / "work" / "criu.conf").read_text() == "tcp-close\n"


def test_a_failed_restore_names_pod_container_phase_and_criu_line(env: dict[str, Path]) -> None:
    _plan(env)
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle",
             str(env["bundle"]), CID, extra_env={"FAKE_RUNC_FAIL": "1"})
    assert r.returncode != 0
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["level"] == "error"
    for needle in ("ns/p", "container app", "phase restore", "vol/held.txt", "restore.log"):
        assert needle in last["msg"], last["msg"]


def test_a_hostile_diff_is_refused_before_restore(env: dict[str, Path]) -> None:
    d = _plan(env)
    with tarfile.open(d / "rootfs-diff.tar", "w") as tf:
        info = tarfile.TarInfo("../../escape")
        info.size = 0
        tf.addfile(info)
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "create", "--bundle", str(env["bundle"]), CID)
    assert r.returncode != 0
    assert not env["record"].exists(), "runc must not run after a refused diff"
    assert "phase rootfs" in log.read_text()
    assert not (env["tmp"] / "escape").exists()


def _lazy_plan(env: dict[str, Path]) -> Path:
    d = _plan(env)
    plan = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**plan, "lazy": True}))
    return d


def test_a_lazy_plan_restores_with_lazy_pages_and_keeps_the_images_for_the_daemon(env: dict[str, Path]) -> None:
    d = _lazy_plan(env)
    (d / "work").mkdir()
    (d / "work" / "lazy-pages.socket").write_text("")
    r = _run(env, "--root", "/r", "create", "--bundle", str(env["bundle"]), CID)
    assert r.returncode == 0, r.stderr
    argv = _argv(env)
    assert "--lazy-pages" in argv and "--auto-dedup" not in argv
    assert argv[argv.index("--work-path") + 1] == str(d / "work")
    assert (d / "restored").exists() and (d / "images" / "inventory.img").exists()


@pytest.mark.parametrize("failed", [False, True])
def test_a_lazy_plan_without_its_page_source_fails_clearly(env: dict[str, Path], failed: bool) -> None:
    d = _lazy_plan(env)
    if failed:
        (d / "work").mkdir()
        (d / "work" / "lazy-pages.socket").write_text("")
        (d / "lazy.failed").write_text("blob sha256:0f missing")
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle",
             str(env["bundle"]), CID)
    assert r.returncode != 0 and not env["record"].exists()
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert "ns/p" in msg and "container app" in msg and "phase lazy-pages" in msg
    assert ("blob sha256:0f missing" in msg) if failed else ("page source for this container is gone" in msg)


@pytest.mark.parametrize("answer", ["ok", "failed checkpoint x: pages-1.img at offset 0: digest mismatch", ""])
def test_a_paged_plan_asks_its_page_source_for_the_memory_before_criu_runs(env: dict[str, Path], answer: str) -> None:
    d = _lazy_plan(env)
    plan = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**plan, "memory_at_start": True}))
    (d / "work").mkdir()
    (d / "work" / "lazy-pages.socket").write_text("")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    resumegate.at_path(listener.bind, str(d / "work" / resumegate.MEMORY_SOCKET_NAME))
    listener.listen(1)
    asked: list[bool] = []

    def source() -> None:  # the page source: one request, answered once the pages file is written
        conn, _ = listener.accept()
        with conn:
            asked.append(not env["record"].exists())  # before runc runs
            if answer == "ok":
                (d / "images" / "pages-1.img").write_bytes(b"")
            if answer:
                conn.sendall(answer.encode() + b"\n")

    thread = threading.Thread(target=source)
    thread.start()
    log = env["tmp"] / "log.json"
    try:
        r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle",
                 str(env["bundle"]), CID)
    finally:
        thread.join(30)
        listener.close()
    assert asked == [True]
    if answer == "ok":
        assert r.returncode == 0, r.stderr
        assert "--lazy-pages" in _argv(env)
        return
    assert r.returncode != 0 and not env["record"].exists()
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert "container app" in msg and "phase lazy-pages" in msg
    assert ("digest mismatch" in msg) if answer else ("before it wrote the memory" in msg)


def test_a_paged_plan_whose_agent_is_gone_fails_naming_the_agent(env: dict[str, Path]) -> None:
    d = _lazy_plan(env)
    plan = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**plan, "memory_at_start": True}))
    (d / "work").mkdir()
    (d / "work" / "lazy-pages.socket").write_text("")  # the page source's socket is there, nobody serves the memory
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle",
             str(env["bundle"]), CID)
    assert r.returncode != 0 and not env["record"].exists()
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert "phase lazy-pages" in msg and "the agent that holds this container's memory" in msg


def _spec_with_mark(env: dict[str, Path], nonce: str) -> None:
    (env["bundle"] / "config.json").write_text(json.dumps(
        {**spec(), "root": {"path": "rootfs"}, "annotations": {wrapper.PLAN_ANNOTATION: nonce, "other": "x"}}))


def test_a_marked_container_without_its_plan_is_refused_and_runc_never_runs(env: dict[str, Path]) -> None:
    _spec_with_mark(env, "f" * 32)
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle", str(env["bundle"]),
             "--pid-file", "/p", CID)
    assert r.returncode != 0
    assert not env["record"].exists(), "a marked container must never be created from its image"
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert CID in msg and wrapper.PLAN_ANNOTATION in msg and str(env["plans"]) in msg
    # Other calls on it (delete of the failed create, state) still reach runc.
    assert _run(env, "--root", "/r", "delete", "--force", CID).returncode == 0
    assert _argv(env) == ["--root", "/r", "delete", "--force", CID]


def test_a_marked_container_with_another_plans_nonce_is_refused(env: dict[str, Path]) -> None:
    d = _plan(env)
    plan = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**plan, "nonce": "a" * 32}))
    _spec_with_mark(env, "b" * 32)
    r = _run(env, "--root", "/r", "create", "--bundle", str(env["bundle"]), CID)
    assert r.returncode != 0 and not env["record"].exists()
    assert "phase plan" in (d / "failed").read_text()


def test_a_restore_records_the_container_the_nonce_and_the_restored_pid(env: dict[str, Path]) -> None:
    d = _plan(env)
    plan = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**plan, "nonce": "c" * 32, "checkpoint": "sha256:" + "1" * 64}))
    _spec_with_mark(env, "c" * 32)
    pid_file = env["tmp"] / "init.pid"
    pid_file.write_text("4242")  # what runc restore writes
    r = _run(env, "--root", "/r", "create", "--bundle", str(env["bundle"]), "--pid-file", str(pid_file), CID)
    assert r.returncode == 0, r.stderr
    rec = json.loads((d / "restored").read_text())
    assert rec == {"container_id": CID, "checkpoint": "sha256:" + "1" * 64, "nonce": "c" * 32, "pid": 4242}


def test_a_lock_a_live_process_holds_fails_the_restore_by_name(env: dict[str, Path]) -> None:
    import fcntl

    d = _plan(env)
    vol = env["tmp"] / "vol"
    vol.mkdir()
    lock = vol / "app.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (d / wrapper.LOCKS_FILE).write_text(json.dumps([
            {"path": "/vol/app.lock", "host": str(lock), "kind": "flock", "write": True, "start": 0, "len": 0},
        ]))
        log = env["tmp"] / "log.json"
        r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle",
                 str(env["bundle"]), CID)
        assert r.returncode != 0 and not env["record"].exists()
        msg = json.loads(log.read_text().splitlines()[-1])["msg"]
        assert "phase file-locks" in msg and "/vol/app.lock" in msg and str(lock) in msg
    # A failed plan is never used again: its plaintext (CRIU's images, the writable layer) is gone at once.
    assert (d / "failed").exists() and (d / "plan.json").exists()
    assert not any((d / name).exists() for name in wrapper.PLAN_DATA)


def test_launcher_settings_read_back_what_install_wrote(env: dict[str, Path]) -> None:
    assert wrapper.launcher_settings(str(env["launcher"])) == (str(env["fake"]), str(env["plans"]))
    assert wrapper.launcher_settings(str(env["fake"])) is None
    assert wrapper.launcher_settings(str(env["tmp"] / "missing")) is None
