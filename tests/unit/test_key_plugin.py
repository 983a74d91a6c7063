"""The KMS plugin (`exec` key source): off the event loop, bounded output, a minimal environment, no leftovers.

The plugins here are small scripts. Where a test must show that the event
loop kept serving while a plugin ran, the plugin's answer comes from a server
on that very loop: the plugin cannot finish unless the loop served it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import select
import stat
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from node_agent import errors
from node_agent.config.loading import from_mapping
from node_agent.checkpointing import Checkpointer, CheckpointRequest
from node_agent.cri.types import Pod
from node_agent.errors import FailedPrecondition, InvalidArgument
from node_agent.journal import Journal
from node_agent.keys import MAX_PLUGIN_STDERR, MAX_PLUGIN_STDOUT, PLUGIN_ENV, Keys
from node_agent.metrics import Metrics
from node_agent.store import Store


def _ring(**domains: list[tuple[str, int]]) -> str:
    return json.dumps({"domains": {d: [{"id": k, "key": base64.b64encode(bytes([n]) * 32).decode()}
                                       for k, n in keys] for d, keys in domains.items()}})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _keys(source: dict[str, Any], clock: Clock | None = None, **more: Any) -> Keys:
    settings = from_mapping({"encryption": {"key-sources": [source], **more}}).encryption
    return Keys(settings, clock=clock or Clock())


def _plugin(path: Path, body: str, *, python: bool = False) -> str:
    path.write_text((f"#!{sys.executable}\n" if python else "#!/bin/sh\n") + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


class LoopKms:
    """A key server on the test's event loop: each connection gets the next answer (the last one repeats)."""

    def __init__(self, path: Path, answers: list[str]) -> None:
        self.path = path
        self.answers = answers
        self.served: list[int] = []

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.served.append(len(self.served))
        writer.write(self.answers[min(len(self.served), len(self.answers)) - 1].encode())
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> LoopKms:
        self.server = await asyncio.start_unix_server(self._answer, path=str(self.path))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.server.close()
        await self.server.wait_closed()

    def plugin(self, path: Path) -> str:
        """A plugin that prints what this server answers (so it ends only once the loop has served it)."""
        return _plugin(path, (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"s.connect({str(self.path)!r})\n"
            "data = b''\n"
            "while chunk := s.recv(65536):\n"
            "    data += chunk\n"
            "sys.stdout.buffer.write(data)\n"
        ), python=True)


@pytest.fixture
async def kms(tmp_path: Path) -> AsyncIterator[LoopKms]:
    async with LoopKms(tmp_path / "kms.sock", [_ring(ns=[("ns-1", 1)]), _ring(ns=[("ns-2", 2), ("ns-1", 1)])]) as k:
        yield k


async def test_on_the_event_loop_a_plugin_is_started_never_waited_for(kms: LoopKms, tmp_path: Path) -> None:
    clock = Clock()
    # From a worker thread the first run is waited for; the loop serves it meanwhile.
    k = await asyncio.to_thread(_keys, {"exec": [kms.plugin(tmp_path / "kms")]}, clock)
    assert kms.served == [0] and (key := k.key("ns-1")) is not None and key.secret == bytes([1]) * 32
    clock.now += 11  # a missing key id may ask the plugin again
    # On the loop's own thread the run starts, and the call returns at once without it: the run
    # cannot have ended, since its answer needs this loop, which has not run since.
    assert k.key("ns-2") is None
    assert kms.served == [0]
    # A worker thread waits for the run in flight, and the loop serves it meanwhile.
    found = await asyncio.to_thread(k.key, "ns-2")
    assert found is not None and found.secret == bytes([2]) * 32
    assert kms.served == [0, 1]


class FakeCri:
    """Pods are listed; containers cannot be (the checkpoint ends there, after its key check)."""

    def __init__(self) -> None:
        self.pod = Pod("cd" * 32, "web", "ns", "u1", 0, "SANDBOX_READY", 0)

    async def list_pods(self) -> list[Pod]:
        return [self.pod]

    async def list_containers(self, pod_id: str) -> list[Any]:
        raise errors.Unavailable("the fake CRI lists no containers")


async def test_a_checkpoint_asks_for_its_key_off_the_event_loop(tmp_path: Path) -> None:
    """The checkpoint's key check waits for a due plugin run, whose answer only the event loop can serve."""
    async with LoopKms(tmp_path / "kms.sock", ["not a keyring", _ring(ns=[("ns-1", 1)])]) as kms:
        clock = Clock()
        source = {"exec": [kms.plugin(tmp_path / "kms")]}
        k = await asyncio.to_thread(_keys, source, clock, **{"refresh-interval": 60})
        with pytest.raises(FailedPrecondition, match="has not given any keys"):
            k.seal_key("ns")  # the first answer was no keyring: nothing may be sealed yet
        clock.now += 61
        settings = from_mapping({"store": str(tmp_path / "store"), "pre-dump": "never"})
        cri: Any = FakeCri()
        checkpointer = Checkpointer(settings, cri, Store(settings.store), Journal(settings.journal_dir),
                                    None, Metrics(), keys=k)  # type: ignore[arg-type]
        # Past the key check (which needed the loop to serve the plugin), to the fake's refusal.
        with pytest.raises(errors.Unavailable, match="the fake CRI lists no containers"):
            await checkpointer.checkpoint(CheckpointRequest(pod="ns/web"))
        assert kms.served == [0, 1]
        assert (key := k.seal_key("ns")) is not None and key.key_id == "ns-1"


@pytest.mark.parametrize("stream, bound", [("", MAX_PLUGIN_STDOUT), (" >&2", MAX_PLUGIN_STDERR)])
def test_a_plugin_printing_past_its_bound_is_stopped_and_refused(tmp_path: Path, stream: str, bound: int) -> None:
    plugin = _plugin(tmp_path / "kms", f"exec yes{stream}\n")
    k = _keys({"exec": [plugin]})
    name = "stderr" if stream else "stdout"
    with pytest.raises(FailedPrecondition, match=(
            f"encryption key source exec {plugin} has not given any keys "
            rf"\(printed more than {bound} bytes on {name}; stopped\)")):
        k.seal_key("ns")


def test_the_plugin_gets_only_the_documented_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KMS_TOKEN", "t0k3n")
    monkeypatch.setenv("AGENT_SECRET", "not for plugins")
    seen = tmp_path / "seen.json"
    plugin = _plugin(tmp_path / "kms", (
        "import json, os\n"
        f"with open({str(seen)!r}, 'w') as fh:\n"
        "    json.dump({'env': dict(os.environ), 'cwd': os.getcwd(), 'stdin': os.readlink('/proc/self/fd/0'),\n"
        "               'leader': os.getsid(0) == os.getpid() == os.getpgid(0)}, fh)\n"
        f"print({_ring(ns=[('ns-1', 1)])!r})\n"
    ), python=True)
    k = _keys({"exec": [plugin], "env": ["KMS_TOKEN", "NOT_SET_ANYWHERE"]})
    assert (key := k.seal_key("ns")) is not None and key.key_id == "ns-1"
    got = json.loads(seen.read_text())
    assert got["env"] == {**PLUGIN_ENV, "KMS_TOKEN": "t0k3n"}
    assert PLUGIN_ENV == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    assert (got["cwd"], got["stdin"], got["leader"]) == ("/", "/dev/null", True)


def test_a_timeout_kills_the_plugins_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    plugin = _plugin(tmp_path / "kms", f"sleep 1000 &\necho $! > {pid_file}\nwait\n")
    k = _keys({"exec": [plugin], "timeout": 2})
    with pytest.raises(FailedPrecondition, match=r"\(did not answer within 2s\)"):
        k.seal_key("ns")
    child = int(pid_file.read_text())
    try:
        fd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # gone and reaped already
    try:
        # Readable once the process has exited; the kill was sent before the refusal came back.
        assert select.select([fd], [], [], 30)[0] == [fd], f"the plugin's child {child} outlived its timeout"
    finally:
        os.close(fd)


def test_a_plugins_environment_is_checked_in_the_config() -> None:
    for source, match in (
        ({"file": "/k.yaml", "env": ["KMS_TOKEN"]}, r"env: only a plugin \(exec\) has an environment"),
        ({"exec": ["/kms"], "env": ["KMS-TOKEN"]}, "'KMS-TOKEN' is not an environment variable name"),
        ({"exec": ["/kms"], "env": "KMS_TOKEN"}, "env"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            from_mapping({"encryption": {"key-sources": [source]}})
    parsed = from_mapping({"encryption": {"key-sources": [{"exec": ["/kms"], "env": ["AWS_REGION"]}]}})
    assert parsed.encryption.key_sources[0].env == ("AWS_REGION",)
