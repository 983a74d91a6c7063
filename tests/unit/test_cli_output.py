"""The CLI's `-o/--output` flag and each command's default output, against a fake daemon.

The default (human) output of every command is pinned byte for byte here:
scripts and the demo parse `restore` and `checkpoints inspect`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from node_agent.cli import client as cli_client
from node_agent.cli.client import pb
from node_agent.cli.main import build_parser, main

CKPT = "sha256:" + "ab" * 32

INFO = pb.CheckpointInfo(
    id=CKPT, pod_namespace="shop", pod_name="cart", pod_uid="u-1", pod_sandbox_id="s" * 64,
    created="2024-05-01T10:20:30.123456Z", size=3 << 20, stored_size=1 << 20, frozen_ms=123.46,
    options={"tcp-established": "true", "file-locks": "true"}, criu_version="4.2", node="node-a",
    containers=[pb.ContainerInfo(name="app", id="c1", image="nginx:1", size=2048, dump_log="containers/app/dump.log",
                                 dump_ms=40.4)],
)
RESTORED = pb.RestoreResult(
    pod_sandbox_id="n" * 64, namespace="staging", name="cart-copy", checkpoint_id=CKPT, started=True,
    containers=[pb.RestoredContainer(name="app", container_id="k" * 64),
                pb.RestoredContainer(name="side", container_id="m" * 64)],
)
PUSHED = pb.TransferResult(checkpoint_id=CKPT, reference="reg.local/shop/cart:v1", blobs_transferred=3,
                           blobs_skipped=2, bytes_transferred=5 << 20)

ANSWERS: dict[str, Any] = {
    "Checkpoint": [pb.CheckpointEvent(progress=pb.Progress(phase="dump")), pb.CheckpointEvent(result=INFO)],
    "Restore": [pb.RestoreEvent(result=RESTORED)],
    "ListCheckpoints": pb.ListCheckpointsResponse(checkpoints=[INFO]),
    "InspectCheckpoint": INFO,
    "RemoveCheckpoint": pb.RemoveCheckpointResponse(checkpoint_id=CKPT),
    "VerifyCheckpoint": pb.VerifyCheckpointResponse(checkpoint_id=CKPT, ok=True, blobs_checked=7),
    "GarbageCollect": pb.GarbageCollectResponse(removed_checkpoints=[CKPT], removed_blobs=4, bytes_freed=9 << 20,
                                                kept=2),
    "Push": [pb.TransferEvent(result=PUSHED)],
    "Pull": [pb.TransferEvent(result=PUSHED)],
    "ImportArchive": INFO,
    "ExportArchive": [pb.ArchiveChunk(data=b"tar-bytes")],
}


class FakeClient:
    """The daemon's answers, without a daemon."""

    def __enter__(self) -> "FakeClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def call(self, method: str, request: Any, timeout: float | None = 60.0) -> Any:
        if method == "ImportArchive":
            list(request)  # the CLI's generator reads the archive
        return ANSWERS[method]

    def stream(self, method: str, request: Any, timeout: float | None) -> Iterator[Any]:
        yield from ANSWERS[method]


@pytest.fixture(autouse=True)
def fake_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_client.Client, "of", classmethod(lambda cls, args: FakeClient()))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


INSPECT_TEXT = f"""\
id:              {CKPT}
pod_namespace:   shop
pod_name:        cart
pod_uid:         u-1
pod_sandbox_id:  {"s" * 64}
created:         2024-05-01T10:20:30.123456Z
node:            node-a
criu_version:    4.2
size:            3.0MiB (stored 1.0MiB)
frozen_ms:       123.5
encryption:      none
signed by:       nobody
options:         file-locks=true, tcp-established=true
containers:
  app: image nginx:1, 2.0KiB, dump 40 ms, log containers/app/dump.log
"""

RESTORE_TEXT = f"{'n' * 64}\napp {'k' * 64}\nside {'m' * 64}\n"

DEFAULTS = [
    (["checkpoint", "shop/cart"], f"{CKPT}\n"),
    (["restore", CKPT[:19]], RESTORE_TEXT),
    (["checkpoints", "inspect", CKPT[:19]], INSPECT_TEXT),
    (["checkpoints", "ls"],
     "ID                   POD        CONTAINERS  CREATED              SIZE    FROZEN_MS  KEY\n"
     "sha256:abababababab  shop/cart  app         2024-05-01 10:20:30  3.0MiB  123        -\n"),
    (["checkpoints", "verify", CKPT], f"{CKPT}: OK (7 blobs)\n"),
    (["checkpoints", "rm", CKPT], f"{CKPT}\n"),
    (["gc"], f"removed {CKPT}\nremoved 1 checkpoint(s) and 4 blob(s), 9.0MiB; 2 checkpoint(s) kept\n"),
    (["push", CKPT, "reg.local/shop/cart:v1"],
     f"pushed {CKPT} to reg.local/shop/cart:v1: 3 blob(s) uploaded (5.0MiB), 2 already there\n"),
    (["pull", "reg.local/shop/cart:v1"], f"{CKPT}\n"),
]


@pytest.mark.parametrize("argv, text", DEFAULTS, ids=[" ".join(a[:2]) for a, _ in DEFAULTS])
def test_each_command_keeps_its_default_output(capsys: pytest.CaptureFixture[str], argv: list[str], text: str) -> None:
    assert run(capsys, *argv) == text


def test_import_prints_the_new_id(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "a.tar").write_bytes(b"x")
    assert run(capsys, "import", str(tmp_path / "a.tar")) == f"{CKPT}\n"


def _output_commands() -> dict[str, list[str]]:
    """Every command that takes -o/--output, with its output choices."""
    found: dict[str, list[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, [*path, name])
            elif "--output" in action.option_strings:
                assert action.option_strings == ["-o", "--output"] and action.choices is not None
                found[" ".join(path)] = list(action.choices)

    walk(build_parser(), [])
    return found


def test_every_output_flag_is_the_shared_one() -> None:
    found = _output_commands()
    assert {"checkpoint", "restore", "gc", "push", "pull", "import", "checkpoints ls", "devices ls"} <= set(found)
    assert "export" not in found
    for command, choices in found.items():
        # The human form first, where there is one, then the formats for programs.
        assert choices in (["table", "json", "yaml"], ["id", "json", "yaml"], ["json", "yaml"]), command


@pytest.mark.parametrize("argv, human", [(["restore", "x"], "id"), (["gc"], "table"), (["push", "x", "r"], "table"),
                                         (["pull", "r"], "id")])
def test_text_still_selects_the_human_output(argv: list[str], human: str) -> None:
    assert build_parser().parse_args([*argv, "-o", "text"]).output == human
    assert build_parser().parse_args(argv).output == human


@pytest.mark.parametrize("argv", [a for a, _ in DEFAULTS], ids=[" ".join(a[:2]) for a, _ in DEFAULTS])
def test_json_and_yaml_carry_the_same_data(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    as_json = json.loads(run(capsys, *argv, "-o", "json"))
    assert as_json and yaml.safe_load(run(capsys, *argv, "-o", "yaml")) == as_json


def test_export_writes_the_file_given_with_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "c.tar"
    assert run(capsys, "export", CKPT, "--container", "app", "--file", str(out)) == f"{out}\n"
    assert out.read_bytes() == b"tar-bytes"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["-o", "--output-file"])
def test_export_o_file_still_works_with_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str) -> None:
    out = tmp_path / "c.tar"
    assert main(["export", CKPT, "--container", "app", flag, str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{out}\n" and out.read_bytes() == b"tar-bytes"
    assert captured.err == f"node-agent: warning: export {flag} FILE is deprecated and goes in the next release; use --file FILE\n"


def test_export_needs_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["export", CKPT, "--container", "app"])
    assert exc.value.code == 2 and "--file" in capsys.readouterr().err
