"""Push, pull, export and import: the `transfers` service, and the servicer's calls that adapt it.

The calls go over a real Unix socket to the servicer; pushes and pulls to a
real registry (docker-registry on 127.0.0.1). What a caller sees stays put:
the status codes and texts of refusals, the streamed progress and results,
and no scratch space left behind.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import sys
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from node_agent import errors, transfers
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.agent import AgentServicer
from node_agent.config.loading import from_mapping
from node_agent.progress import Progress
from node_agent.registry import Credentials
from node_agent.registry import Progress as Moved
from node_agent.registry import ProgressCallback
from node_agent.registry.fetching import RemoteBlobs, repository_key
from node_agent.store import Store
from test_interop import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.registry import Registry  # noqa: E402


class Agent:
    """The servicer, with a `Transfers` of its own, on a Unix socket."""

    def __init__(self, root: Path) -> None:
        self.settings = from_mapping({"store": str(root / "store"), "socket": str(root / "agent.sock")})
        self.store = Store(self.settings.store)
        self.record, _ = make_checkpoint(self.store)
        self.remote = RemoteBlobs(self.store, settings=self.settings.registry)
        self.transfers = transfers.Transfers(self.settings, self.store, seal_for=lambda namespace: None,
                                             remote=self.remote)
        self.socket = str(root / "agent.sock")

    async def __aenter__(self) -> Agent:
        checkpointer = SimpleNamespace(settings=self.settings)
        servicer = AgentServicer(checkpointer, None, self.store, lambda dry_run=False: None,  # type: ignore[arg-type]
                                 transfers=self.transfers, rekeyer=None)  # type: ignore[arg-type]
        self.server = grpc.aio.server()
        pb_grpc.add_NodeAgentServicer_to_server(servicer, self.server)  # type: ignore[no-untyped-call]
        self.server.add_insecure_port("unix://" + self.socket)
        await self.server.start()
        self.channel = grpc.aio.insecure_channel("unix://" + self.socket)
        self.stub = pb_grpc.NodeAgentStub(self.channel)  # type: ignore[no-untyped-call]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.channel.close()
        await self.server.stop(grace=1)

    async def scratch(self) -> list[str]:
        """What is left in the scratch space once the calls have ended (a refused call may end after its status)."""
        left: list[str] = []
        for _ in range(100):
            left = os.listdir(self.settings.work_dir) if os.path.isdir(self.settings.work_dir) else []
            if not left:
                break
            await asyncio.sleep(0.05)
        return left


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    async with Agent(tmp_path) as a:
        yield a


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path / "registry", users={"alice": "pw-of-alice"}) as r:
        yield r


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_export_and_import_by_path_refuse_relative_paths(agent: Agent) -> None:
    err = await _refused(agent.stub.Export(pb.ExportRequest(checkpoint_id=agent.record.id, container="app",
                                                            output_path="rel.tar")))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "the output path must be absolute")
    err = await _refused(agent.stub.Import(pb.ImportRequest(input_path="rel.tar")))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "the input path must be absolute")


async def test_export_to_a_path_then_import_it(agent: Agent, tmp_path: Path) -> None:
    out = tmp_path / "app.tar"
    got = await agent.stub.Export(pb.ExportRequest(checkpoint_id=agent.record.id.removeprefix("sha256:")[:12], container="app",
                                                   output_path=str(out)))
    assert got.output_path == str(out) and got.size == out.stat().st_size > 0
    err = await _refused(agent.stub.Export(pb.ExportRequest(checkpoint_id=agent.record.id, container="app",
                                                            output_path=str(out))))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    info = await agent.stub.Import(pb.ImportRequest(input_path=str(out), namespace="elsewhere", name="copy"))
    assert (info.pod_namespace, info.pod_name) == ("elsewhere", "copy")
    assert info.id in {r.id for r in agent.store.list()}


async def test_an_archive_streamed_out_and_back_in_leaves_no_scratch(agent: Agent) -> None:
    err = await _refused(agent.stub.ExportArchive(pb.ExportRequest(
        checkpoint_id=agent.record.id, container="app", output_path="/tmp/x.tar")).read())
    assert (err.code(), err.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "ExportArchive streams the archive: give no output path")
    data = b"".join([c.data async for c in agent.stub.ExportArchive(
        pb.ExportRequest(checkpoint_id=agent.record.id, container="app"))])
    assert tarfile.open(fileobj=io.BytesIO(data)).getnames()  # "none" compression: a plain tar
    assert await agent.scratch() == []

    def chunks(header: pb.ImportRequest | None, *, data_first: bool = False) -> list[pb.ImportChunk]:
        body = [pb.ImportChunk(data=data[i:i + 4096]) for i in range(0, len(data), 4096)]
        head = [pb.ImportChunk(header=header)] if header is not None else []
        return body[:1] + head + body[1:] if data_first else head + body

    info = await agent.stub.ImportArchive(iter(chunks(pb.ImportRequest(namespace="elsewhere"))))
    assert info.pod_namespace == "elsewhere"
    assert await agent.scratch() == []
    first = "ImportArchive: the first message is the header, without an input path"
    for stream, details in (
        (chunks(None), first),
        (chunks(pb.ImportRequest(input_path="/tmp/x.tar")), first),
        ([], "ImportArchive: no header came"),
        (chunks(pb.ImportRequest()) + chunks(pb.ImportRequest())[:1], "ImportArchive: one header, then data"),
    ):
        # As the CLI sends it: grpc's synchronous client, whose request stream stops when the call has ended
        # (the asyncio client may report its own failure to write after the refusal instead of the refusal).
        err = await asyncio.to_thread(_refused_import, agent.socket, stream)
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert await agent.scratch() == []


def _refused_import(socket_path: str, stream: list[pb.ImportChunk]) -> grpc.RpcError:
    with grpc.insecure_channel("unix://" + socket_path) as channel:
        stub = pb_grpc.NodeAgentStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as info:
            stub.ImportArchive(iter(stream), timeout=60)
    return info.value


def test_a_streamed_archive_that_would_fill_the_disk_is_refused(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    with pytest.raises(errors.ResourceExhausted, match="would leave less than min-free-bytes"):
        transfers.keep_free(str(tmp_path), st.f_bavail * st.f_frsize * 2 + (1 << 30), 5 << 20)
    transfers.keep_free(str(tmp_path), 0, 5 << 20)


async def test_push_and_pull_stream_progress_then_a_result(agent: Agent, registry: Registry, tmp_path: Path) -> None:
    creds = pb.RegistryCredentials(username="alice", password="pw-of-alice", plain_http=True)
    ref = registry.ref("ckpt/web:v1")
    events = [e async for e in agent.stub.Push(pb.PushRequest(checkpoint_id=agent.record.id.removeprefix("sha256:")[:12], reference=ref,
                                                              credentials=creds))]
    assert events and all(e.WhichOneof("event") == "progress" for e in events[:-1])
    assert re.fullmatch(r"\d+/\d+ blobs, 0 already there", events[-2].progress.message)
    assert events[-2].progress.bytes_done == events[-2].progress.bytes_total > 0
    pushed = events[-1].result
    assert pushed.checkpoint_id == agent.record.id  # the manifest's digest
    assert pushed.reference == ref and pushed.blobs_transferred > 0 and pushed.bytes_transferred > 0

    async with Agent(tmp_path / "other") as other:
        events = [e async for e in other.stub.Pull(pb.PullRequest(reference=ref, credentials=creds))]
        pulled = events[-1].result
        assert (pulled.checkpoint_id, pulled.reference) == (agent.record.id, ref)
        assert pulled.blobs_transferred > 0 and pulled.bytes_transferred > 0
        assert other.remote.passwords == {}  # a whole pull leaves no password behind

    err = await _refused(agent.stub.Push(pb.PushRequest(checkpoint_id="abcdef123456", reference=ref,
                                                        credentials=creds)).read())
    assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_a_transfer_sends_a_progress_event_per_interval_within_a_phase_and_every_new_phase(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(transfers, "_clock", lambda: now[0])
    sent: list[Progress] = []

    def work(relay: ProgressCallback) -> str:
        relay(Moved("manifest", 0, 3, 0, 3 << 20, 0))
        for piece in range(1, 301):  # 300 pieces of a MiB, 1/32 s apart (exact in binary)
            relay(Moved("blobs", piece // 100, 3, piece << 20, 3 << 20, 0))
            now[0] += 1 / 32
        relay(Moved("done", 3, 3, 3 << 20, 3 << 20, 0))
        return "ok"

    assert await transfers._in_thread(work, "registry.example/ckpt:1", sent.append) == "ok"
    await asyncio.sleep(0)  # the last event was handed to the loop before the work returned
    phases = [p.phase for p in sent]
    assert phases[0] == "manifest" and phases[-1] == "done"
    assert phases.count("blobs") == 75, "one event per 0.1 s of a phase (every 4th piece here), not one per piece"
    assert sent[-1].bytes_done == sent[-1].bytes_total == 3 << 20 and sent[-1].message == "3/3 blobs, 0 already there"


async def test_a_lazy_pull_keeps_the_password_for_the_fetcher(agent: Agent, registry: Registry, tmp_path: Path) -> None:
    creds = Credentials("alice", "pw-of-alice", plain_http=True)
    ref = registry.ref("ckpt/web:lazy")
    seen: list[Progress] = []
    await agent.transfers.push(transfers.PushRequest(agent.record.id, ref, creds), seen.append)
    assert seen and all(re.fullmatch(r"\d+/\d+ blobs, \d+ already there", p.message) for p in seen)
    other = Agent(tmp_path / "other")
    result = await other.transfers.pull(transfers.PullRequest(ref, creds, lazy=True), seen.append)
    assert result.checkpoint_id == agent.record.id
    assert other.remote.passwords == {repository_key(ref): "pw-of-alice"}
