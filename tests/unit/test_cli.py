"""CLI commands that work without a daemon, and the CLI's error paths."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from node_agent.cli.containerd_config import snippet
from node_agent.config.schema import Settings
from node_agent.errors import InvalidArgument

NODE_AGENT = str(Path(sys.executable).parent / "node-agent")


@pytest.mark.parametrize("version, plugin", [(2, "io.containerd.grpc.v1.cri"), (3, "io.containerd.cri.v1.runtime")])
def test_containerd_snippet_is_only_the_handler_tables_with_absolute_paths(version: int, plugin: str) -> None:
    text = snippet(Settings(store="/srv/na", runtime_handler="restore", runc_root="/run/x/runc/k8s.io"), version)
    assert "version" not in text
    doc = tomllib.loads(text)
    runtime = doc["plugins"][plugin]["containerd"]["runtimes"]["restore"]
    assert runtime["runtime_type"] == "io.containerd.runc.v2"
    assert runtime["options"] == {"BinaryName": "/srv/na/bin/node-agent-runc", "Root": "/run/x/runc", "SystemdCgroup": False}
    assert runtime["container_annotations"] == ["node-agent.io/restore-plan"]
    assert runtime.get("sandboxer") == ("podsandbox" if version == 3 else None)
    assert list(doc) == ["plugins"]


def test_containerd_snippet_refuses_a_runc_root_the_shim_cannot_produce() -> None:
    with pytest.raises(InvalidArgument, match="k8s.io"):
        snippet(Settings(runc_root="/run/runc"), 2)


def test_containerd_config_command_installs_the_launcher(tmp_path: Path) -> None:
    cp = subprocess.run([NODE_AGENT, "containerd-config", "--store", str(tmp_path / "s"), "--runtime-handler", "criu",
                         "--config-version", "2"], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    launcher = tmp_path / "s" / "bin" / "node-agent-runc"
    assert f'BinaryName = "{launcher}"' in cp.stdout
    assert os.access(launcher, os.X_OK)
    # The launcher passes plain calls straight to runc.
    out = subprocess.run([str(launcher), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "runc version" in out.stdout


def test_doctor_exits_zero_on_this_machine() -> None:
    cp = subprocess.run([NODE_AGENT, "doctor"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    verdicts = [line.split()[0] for line in cp.stdout.splitlines()]
    assert verdicts and set(verdicts) <= {"OK", "WARN"}
    assert any(line.startswith("OK   criu:") for line in cp.stdout.splitlines()), cp.stdout
    lazy = [line for line in cp.stdout.splitlines() if "lazy" in line.split(":")[0]]
    assert len(lazy) == 1 and lazy[0].startswith(("OK   lazy restore:", "WARN lazy restore:")), cp.stdout


def test_daemon_commands_say_when_no_daemon_runs(tmp_path: Path) -> None:
    env = dict(os.environ, NODE_AGENT_SOCKET=str(tmp_path / "none.sock"))
    cp = subprocess.run([NODE_AGENT, "checkpoints", "ls"], capture_output=True, text=True, env=env, timeout=60)
    assert cp.returncode != 0
    assert "not running" in cp.stderr and str(tmp_path / "none.sock") in cp.stderr


def test_bad_option_syntax_is_a_usage_error(tmp_path: Path) -> None:
    env = dict(os.environ, NODE_AGENT_SOCKET=str(tmp_path / "none.sock"))
    cp = subprocess.run([NODE_AGENT, "checkpoint", "ns/p", "--option", "=x"], capture_output=True, text=True, env=env)
    assert cp.returncode == 2 and "KEY=VALUE" in cp.stderr


def test_a_relative_socket_path_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from node_agent.cli.client import socket_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NODE_AGENT_SOCKET", raising=False)
    assert socket_path("agent.sock") == str(tmp_path / "agent.sock")
    monkeypatch.setenv("NODE_AGENT_SOCKET", "sub/agent.sock")
    assert socket_path(None) == str(tmp_path / "sub" / "agent.sock")


def test_every_settings_flag_reaches_its_setting() -> None:
    """The flags of `serve` are config keys: each one given lands in Settings under its own name."""
    from node_agent.cli.configflags import settings_from
    from node_agent.cli.main import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = [a for a in serve._actions if a.option_strings and a.dest not in ("help", "config")]
    argv = ["serve"]
    for a in flags:
        argv += [a.option_strings[0], a.choices[-1] if a.choices else "/x" if a.metavar in ("DIR", "PATH", "FILE") else "9100"]
    args = parser.parse_args(argv)
    given = {a.dest: getattr(args, a.dest) for a in flags}
    # The listener needs its TLS files and a HOST:PORT; the CRI listener a unix:/// URL.
    given.update(listen="127.0.0.1:9443", cri_listen="unix:///x", cri_endpoint="unix:///x")
    for dest, value in given.items():
        setattr(args, dest, value)
    s = settings_from(args)
    assert {dest: getattr(s, dest) for dest in given} == given


def test_config_flags_come_from_the_schema(tmp_path: Path) -> None:
    """Each config flag is its key's name with its schema description as help; a flag given beats the file."""
    import msgspec

    from node_agent.cli.configflags import HANDLER, LISTENERS, SERVE, SETTINGS, settings_from
    from node_agent.cli.main import build_parser
    from node_agent.config.schema import Document

    fields = {f.name: f for f in msgspec.structs.fields(Document)}
    parser = build_parser()
    commands: Any = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command, declared in (("serve", SETTINGS + LISTENERS + SERVE), ("doctor", SETTINGS),
                              ("install-handler", SETTINGS), ("containerd-config", HANDLER)):
        actions = {a.dest: a for a in commands[command]._actions}
        for name, _ in declared:
            action = actions[name]
            assert action.option_strings == ["--" + fields[name].encode_name]
            if command == "containerd-config":
                assert action.help is None
    serve = {a.dest: a for a in commands["serve"]._actions}
    assert serve["store"].help == f"checkpoint store (default {Settings().store})"
    assert serve["log_format"].choices == ("text", "json") and serve["log_level"].help is None
    assert serve["metrics_listen"].metavar == "[HOST:]PORT"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store: /from/file\nruntime-handler: file\n")
    args = parser.parse_args(["serve", "--config", str(cfg), "--store", "/from/flag"])
    s = settings_from(args)
    assert (s.store, s.runtime_handler) == ("/from/flag", "file")
