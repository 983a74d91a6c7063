"""The CRI proxy against a tiny fake upstream runtime on a Unix socket."""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any, AsyncIterator, Iterator

import grpc
import pytest

from node_agent.api.cri_proxy import CriProxy, forwardable, is_server_streaming

RT = "/runtime.v1.RuntimeService/"


class FakeRuntime(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Echoes bytes, streams, fails on request, and records what it saw."""

    def __init__(self) -> None:
        self.seen_metadata: dict[str, Any] = {}
        self.seen_timeout: float | None = None
        self.stream_cancelled = asyncio.Event()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = str(details.method)
        name = method.rsplit("/", 1)[-1]
        if name == "GetContainerEvents":
            return grpc.unary_stream_rpc_method_handler(self.events)
        if name == "Fail":
            return grpc.unary_unary_rpc_method_handler(self.fail)
        if name == "Slow":
            return grpc.unary_unary_rpc_method_handler(self.slow)
        return grpc.unary_unary_rpc_method_handler(self.echo)

    async def echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.seen_metadata = dict(context.invocation_metadata() or ())
        self.seen_timeout = context.time_remaining()
        await context.send_initial_metadata((("x-upstream-initial", "1"),))
        context.set_trailing_metadata((("x-upstream-trailer", "yes"),))
        return b"echo:" + request

    async def fail(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no such thing: " + request.decode(),
                            (("x-why", "because"), ("x-bin-bin", b"\x00\x01")))
        return b""

    async def slow(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.seen_timeout = context.time_remaining()
        await asyncio.sleep(30)
        return b""

    async def events(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            for i in range(3):
                yield bytes([0x0A, 1, 0x30 + i]) + request
            if request == b"forever":
                while True:
                    await asyncio.sleep(0.05)
                    yield b"tick"
        except asyncio.CancelledError:
            self.stream_cancelled.set()
            raise


@pytest.fixture
def sockdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="cri-proxy-") as d:
        yield d


async def _pair(sockdir: str, local: dict[str, Any] | None = None) -> tuple[FakeRuntime, Any, Any, grpc.aio.Channel, grpc.aio.Channel]:
    fake = FakeRuntime()
    upstream = grpc.aio.server()
    upstream.add_generic_rpc_handlers((fake,))
    up_sock = os.path.join(sockdir, "upstream.sock")
    upstream.add_insecure_port("unix://" + up_sock)
    await upstream.start()
    up_channel = grpc.aio.insecure_channel("unix://" + up_sock)
    proxy = grpc.aio.server()
    proxy.add_generic_rpc_handlers((CriProxy(up_channel, local),))
    px_sock = os.path.join(sockdir, "proxy.sock")
    proxy.add_insecure_port("unix://" + px_sock)
    await proxy.start()
    client = grpc.aio.insecure_channel("unix://" + px_sock)
    return fake, upstream, proxy, up_channel, client


async def _close(*things: Any) -> None:
    for t in things:
        if isinstance(t, grpc.aio.Channel):
            await t.close()
        else:
            await t.stop(None)


def test_streaming_is_decided_by_name() -> None:
    assert is_server_streaming("/runtime.v1.RuntimeService/GetContainerEvents")
    assert not is_server_streaming("/runtime.v1.ImageService/ImageFsInfo")
    assert forwardable((("user-agent", "x"), (":authority", "y"), ("x-a", "b"))) == (("x-a", "b"),)


def test_unary_bytes_metadata_and_deadline(sockdir: str) -> None:
    async def go() -> None:
        fake, up, px, upch, client = await _pair(sockdir)
        try:
            payload = bytes(range(256)) * 4  # not a valid message of anything: bytes pass untouched
            call = client.unary_unary(RT + "SomeFutureMethod")(payload, timeout=7, metadata=(("x-caller", "kubelet"),))
            assert await call == b"echo:" + payload
            assert fake.seen_metadata.get("x-caller") == "kubelet"
            assert fake.seen_timeout is not None and 1 < fake.seen_timeout < 7.5, fake.seen_timeout
            assert ("x-upstream-initial", "1") in tuple(await call.initial_metadata())
            assert ("x-upstream-trailer", "yes") in tuple(await call.trailing_metadata())
            # ImageService is forwarded too.
            assert await client.unary_unary("/runtime.v1.ImageService/ImageFsInfo")(b"") == b"echo:"
        finally:
            await _close(client, px, upch, up)

    asyncio.run(go())


def test_status_details_and_trailing_metadata(sockdir: str) -> None:
    async def go() -> None:
        _, up, px, upch, client = await _pair(sockdir)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.unary_unary(RT + "Fail")(b"abc")
            exc = info.value
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert exc.details() == "no such thing: abc"
            trailing = dict(exc.trailing_metadata() or ())
            assert trailing.get("x-why") == "because" and trailing.get("x-bin-bin") == b"\x00\x01"
        finally:
            await _close(client, px, upch, up)

    asyncio.run(go())


def test_deadline_expires_upstream(sockdir: str) -> None:
    async def go() -> None:
        fake, up, px, upch, client = await _pair(sockdir)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.unary_unary(RT + "Slow")(b"", timeout=0.5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert fake.seen_timeout is not None and fake.seen_timeout < 1.0
        finally:
            await _close(client, px, upch, up)

    asyncio.run(go())


def test_server_streaming_and_cancellation(sockdir: str) -> None:
    async def go() -> None:
        fake, up, px, upch, client = await _pair(sockdir)
        try:
            stream = client.unary_stream(RT + "GetContainerEvents")(b"")
            got = [m async for m in stream]
            assert got == [b"\x0a\x01\x30", b"\x0a\x01\x31", b"\x0a\x01\x32"]
            assert await stream.code() == grpc.StatusCode.OK

            # A client that cancels mid-stream cancels the upstream stream as well.
            stream = client.unary_stream(RT + "GetContainerEvents")(b"forever")
            n = 0
            async for _ in stream:
                n += 1
                if n == 5:
                    break
            stream.cancel()
            await asyncio.wait_for(fake.stream_cancelled.wait(), 5)
        finally:
            await _close(client, px, upch, up)

    asyncio.run(go())


def test_local_methods_and_other_services(sockdir: str) -> None:
    async def checkpoint_pod(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"local:" + request

    async def go() -> None:
        _, up, px, upch, client = await _pair(sockdir, {RT + "CheckpointPod": checkpoint_pod})
        try:
            assert await client.unary_unary(RT + "CheckpointPod")(b"x") == b"local:x"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.unary_unary("/other.Service/Call")(b"x")
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await _close(client, px, upch, up)

    asyncio.run(go())


def test_cri_listen_setting() -> None:
    from node_agent.config.loading import from_mapping
    from node_agent.errors import InvalidArgument

    assert from_mapping({"cri-listen": "unix:///run/node-agent/cri.sock"}).cri_listen == "unix:///run/node-agent/cri.sock"
    assert from_mapping({}).cri_listen == ""
    for bad in ("localhost:1234", "unix://", "unix://relative/cri.sock"):
        with pytest.raises(InvalidArgument):
            from_mapping({"cri-listen": bad})


def test_output_store_abandoned_writer_stops_and_is_waited_for(tmp_path: Any) -> None:
    from node_agent.api.cri_endpoint import _caller_dir, _empty_dir, _open_store, _OutputWriters
    from node_agent.errors import Cancelled, FailedPrecondition, InvalidArgument

    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(FailedPrecondition):
        _caller_dir("output_path", str(tmp_path / "link"), str(tmp_path / "store"))
    with pytest.raises(InvalidArgument):
        _caller_dir("output_path", str(tmp_path), str(tmp_path / "store"))
    with pytest.raises(InvalidArgument):
        _caller_dir("output_path", "relative", str(tmp_path / "store"))
    assert _caller_dir("output_path", str(out), str(tmp_path / "store")) == str(out)

    writers = _OutputWriters()
    store = _open_store(str(out), None, writers)
    assert (out.stat().st_mode & 0o777) == 0o755, "the caller's directory keeps its mode"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(1 << 20))
    with store.writer() as w:
        writers.abandon()  # the call ends while its writer runs
        with pytest.raises(Cancelled):
            w.add_tree("", str(src))
    assert writers.wait_idle(1.0)
    with pytest.raises(Cancelled):
        store.writer()
    assert writers.wait_idle(1.0)
    _empty_dir(str(out))
    assert list(out.iterdir()) == []

    fresh_writers = _OutputWriters()
    fresh = _open_store(str(out), fresh_writers)
    with fresh.writer() as w:
        w.add_tree("", str(src))
        w.commit({"kind": "test"})
    assert fresh_writers.wait_idle(1.0) and len(fresh.list()) == 1
