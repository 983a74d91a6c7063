"""The agent's CRI endpoint: a CRI client (as the kubelet) pointed at node-agent instead of containerd."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import grpc
import pytest

from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent.cri import CriClient
from node_agent.cri.client import _parse, grpc_target
from node_agent.store import Store
from testbed.bed import (
    SHELL_COUNTER, Bed, PodHandle, container_config, container_detail, freezer_state, pod_config, remove_pod, run,
    ticks, wait_for,
)
from tests.e2e.tap import EventTap

T = TypeVar("T")
RT = "/runtime.v1.RuntimeService/"
RESTORE_FROM = "checkpoint.node-agent.io/restore-from"


def via_agent(bed: Bed, fn: Callable[[CriClient], Awaitable[T]]) -> T:
    """Run `fn` with a CRI client whose endpoint is the agent, not containerd."""
    return run(fn, bed.cri_endpoint)


def raw_call(endpoint: str, method: str, request: bytes, *, timeout: float = 300,
             metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
    async def go() -> bytes:
        async with grpc.aio.insecure_channel(grpc_target(endpoint)) as ch:
            out: bytes = await ch.unary_unary(method)(request, timeout=timeout, metadata=metadata)
            return out

    return asyncio.run(go())


def shell(bed: Bed, name: str = "shell") -> dict[str, Any]:
    return container_config(name, bed.info["images"]["busybox"], ["sh", "-c", SHELL_COUNTER.format(name=name)])


def pod_via_agent(bed: Bed, namespace: str, containers: list[dict[str, Any]], *,
                  annotations: dict[str, str] | None = None, start: bool = True) -> PodHandle:
    """A pod made through the agent's endpoint the way the kubelet makes one."""
    name = f"p-{secrets.token_hex(3)}"
    pcfg = pod_config(bed, namespace, name)
    if annotations:
        pcfg["annotations"] = annotations
    for c in containers:
        os.makedirs(os.path.join(pcfg["log_directory"], c["metadata"]["name"]), exist_ok=True)

    async def go(client: CriClient) -> PodHandle:
        pod_id = await client.run_pod(pcfg, "")
        h = PodHandle(bed, pod_id, namespace, name, pcfg["metadata"]["uid"], pcfg["log_directory"])
        for c in containers:
            cid = await client.create_container(pod_id, c, pcfg)
            if start:
                await client.start_container(cid)
            h.containers[c["metadata"]["name"]] = cid
        return h

    return via_agent(bed, go)


def checkpoint_pod(bed: Bed, pod_id: str, out: str, container_ids: list[str], options: dict[str, str] | None = None,
                   timeout: float = 300) -> None:
    req = cri.CheckpointPodRequest(pod_sandbox_id=pod_id, output_path=out, container_ids=container_ids,
                                   options=options or {})
    raw_call(bed.cri_endpoint, RT + "CheckpointPod", req.SerializeToString(), timeout=timeout)


def _code(fn: Callable[[], Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        fn()
    return info.value


@pytest.mark.also17
def test_pod_run_listed_checkpointed_and_restored_through_the_endpoint(agent: Bed, tmp_path: Path) -> None:
    src = pod_via_agent(agent, "e2e-cri", [shell(agent)])
    dst_id = ""
    try:
        # Listed through the endpoint like through containerd.
        listed = via_agent(agent, lambda c: c.list_pods())
        assert src.id in [p.id for p in listed]
        log = os.path.join(src.log_dir, "shell", "0.log")
        wait_for(lambda: len(ticks(log)) >= 5, what="source ticks")

        out = tmp_path / "ckpt"
        out.mkdir()
        checkpoint_pod(agent, src.id, str(out), [src.containers["shell"]])
        at_checkpoint = max(ticks(log))
        # A self-contained OCI layout with exactly one checkpoint.
        assert (out / "oci-layout").is_file() and (out / "index.json").is_file()
        records = Store(out).list()
        assert len(records) == 1 and records[0].metadata["pod"]["id"] == src.id
        # Not in the agent's own store.
        assert records[0].id not in agent.cli("checkpoints", "ls", "-o", "json").stdout
        # The source pod goes on.
        assert freezer_state(container_detail(agent, src.containers["shell"]).pid) == "THAWED"
        wait_for(lambda: max(ticks(log)) > at_checkpoint + 2, what="source keeps ticking")

        # RestorePod with the caller's new configs, then StartContainer.
        new_name = f"r-{secrets.token_hex(3)}"
        pcfg = pod_config(agent, "e2e-cri-dst", new_name)
        os.makedirs(os.path.join(pcfg["log_directory"], "shell"), exist_ok=True)
        ccfg = shell(agent)
        req = cri.RestorePodRequest(
            checkpoint_path=str(out), config=_parse(pcfg, cri.PodSandboxConfig, "pod"),
            container_configs=[_parse(ccfg, cri.ContainerConfig, "container")],
        )
        resp = cri.RestorePodResponse.FromString(
            raw_call(agent.cri_endpoint, RT + "RestorePod", req.SerializeToString())
        )
        dst_id = resp.pod_sandbox_id
        assert [c.name for c in resp.restored_containers] == ["shell"]
        cid = resp.restored_containers[0].container_id
        d = container_detail(agent, cid)
        assert d.container.state == "CONTAINER_CREATED"
        pd = via_agent(agent, lambda c: c.pod_status(dst_id))
        assert (pd.pod.namespace, pd.pod.name, pd.pod.uid) == ("e2e-cri-dst", new_name, pcfg["metadata"]["uid"])

        # The caller owns checkpoint_path and may delete it once RestorePod
        # returns, even though this restore is lazy (the default).
        shutil.rmtree(out)
        via_agent(agent, lambda c: c.start_container(cid))
        new_log = container_detail(agent, cid).log_path
        assert new_log.startswith(pcfg["log_directory"])
        wait_for(lambda: len(ticks(new_log)) >= 3, what="restored ticks")
        first = ticks(new_log)[0]
        assert first > 5 and first >= at_checkpoint - 1, f"the counter restarted: first tick {first}"
        plan = os.path.join(agent.store, "plans", cid)
        wait_for(lambda: os.path.exists(os.path.join(plan, "lazy.done")), timeout=60, what="every page in")
        # The page source removes its links as it exits, just after it said every page is in.
        wait_for(lambda: not os.path.exists(os.path.join(plan, "source-store")), timeout=15, what="the links to go")
        assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
    finally:
        remove_pod(agent, src.id)
        if dst_id:
            remove_pod(agent, dst_id)


def test_checkpoint_pod_refuses_bad_requests_and_writes_nothing(agent: Bed, tmp_path: Path) -> None:
    src = pod_via_agent(agent, "e2e-cri", [shell(agent)])
    try:
        cid = src.containers["shell"]
        out = tmp_path / "out"
        out.mkdir()
        err = _code(lambda: checkpoint_pod(agent, src.id, str(out), [cid], {"no-such-option": "true"}))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "no-such-option" in (err.details() or "")
        assert list(out.iterdir()) == []
        assert _code(lambda: checkpoint_pod(agent, src.id, str(out), [])).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: checkpoint_pod(agent, src.id, str(out), [cid, cid])).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: checkpoint_pod(agent, src.id, str(out), ["0" * 64])).code() == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: checkpoint_pod(agent, src.id, str(tmp_path / "missing"), [cid])).code() == \
            grpc.StatusCode.FAILED_PRECONDITION
        assert list(out.iterdir()) == []
        (out / "something").write_text("x")
        assert _code(lambda: checkpoint_pod(agent, src.id, str(out), [cid])).code() == grpc.StatusCode.FAILED_PRECONDITION
        assert [p.name for p in out.iterdir()] == ["something"]
        # RestorePod: an unknown option, or container configs that don't match, are INVALID_ARGUMENT.
        bad = cri.RestorePodRequest(checkpoint_path=str(out), options={"bogus": "1"})
        assert _code(lambda: raw_call(agent.cri_endpoint, RT + "RestorePod", bad.SerializeToString())).code() == \
            grpc.StatusCode.INVALID_ARGUMENT
    finally:
        remove_pod(agent, src.id)


def test_restore_pod_of_an_unreadable_checkpoint_says_why(agent: Bed, tmp_path: Path) -> None:
    src = pod_via_agent(agent, "e2e-cri", [shell(agent)])
    try:
        out = tmp_path / "ckpt"
        out.mkdir()
        checkpoint_pod(agent, src.id, str(out), [src.containers["shell"]])
        [rec] = Store(out).list()
        manifest = out / "blobs" / "sha256" / rec.id.removeprefix("sha256:")
        manifest.chmod(0o644)
        manifest.write_bytes(manifest.read_bytes().replace(b'"size":', b'"size":9', 1))  # an absurd size, say
        pcfg = pod_config(agent, "e2e-cri-dst", f"r-{secrets.token_hex(3)}")
        req = cri.RestorePodRequest(checkpoint_path=str(out), config=_parse(pcfg, cri.PodSandboxConfig, "pod"),
                                    container_configs=[_parse(shell(agent), cri.ContainerConfig, "container")])
        err = _code(lambda: raw_call(agent.cri_endpoint, RT + "RestorePod", req.SerializeToString()))
        # The decisive reason, not a count of readable checkpoints.
        assert err.code() == grpc.StatusCode.DATA_LOSS, err
        assert "content hashes to" in (err.details() or "") and str(out) in (err.details() or ""), err.details()
    finally:
        remove_pod(agent, src.id)


def test_cancelled_checkpoint_pod_leaves_the_pod_running_and_output_empty(agent: Bed, tmp_path: Path) -> None:
    imgs = agent.info["images"]
    src = pod_via_agent(agent, "e2e-cri", [
        shell(agent),
        container_config("server", imgs["memhog"], [
            "/usr/local/bin/memhog", "--mib", "512", "--port", "8080", "--file", "/data/memhog.log",
            "--shm", "/dev/shm/server.count", "--interval-ms", "100", "--flip", "1",
        ]),
    ])
    try:
        log = os.path.join(src.log_dir, "shell", "0.log")
        wait_for(lambda: len(ticks(log)) >= 3, what="source ticks")
        out = tmp_path / "cancelled"
        out.mkdir()
        req = cri.CheckpointPodRequest(pod_sandbox_id=src.id, output_path=str(out),
                                       container_ids=list(src.containers.values()))

        async def go() -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(grpc_target(agent.cri_endpoint)) as ch:
                call = ch.unary_unary(RT + "CheckpointPod")(req.SerializeToString(), timeout=300)
                # The layout appears in output_path as the call begins; cancel while 512 MiB are being captured.
                for _ in range(400):
                    if any(out.iterdir()) or call.done():
                        break
                    await asyncio.sleep(0.025)
                await asyncio.sleep(0.3)
                assert not call.done(), "the checkpoint finished before it could be cancelled"
                call.cancel()
                return await call.code()

        assert asyncio.run(go()) == grpc.StatusCode.CANCELLED
        wait_for(lambda: not any(out.iterdir()), timeout=60, what="output_path emptied")
        for cid in src.containers.values():
            wait_for(lambda: freezer_state(container_detail(agent, cid).pid) == "THAWED", timeout=60, what="thawed")
            assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
        n = max(ticks(log))
        wait_for(lambda: max(ticks(log)) > n + 2, what="the pod keeps running")
        assert not any(out.iterdir())
    finally:
        remove_pod(agent, src.id)


def _fields(msg: bytes) -> dict[int, Any]:
    """The top-level fields of a protobuf message (first occurrence of each)."""
    out: dict[int, Any] = {}
    for num, _, val, _ in _wire(msg):
        out.setdefault(num, val)
    return out


def _wire(msg: bytes) -> list[tuple[int, int, Any, bytes]]:
    """Every top-level field of a protobuf message: (number, wire type, value, its raw bytes)."""
    out: list[tuple[int, int, Any, bytes]] = []
    i = 0

    def varint() -> int:
        nonlocal i
        v = shift = 0
        while True:
            b = msg[i]
            i += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v

    while i < len(msg):
        start = i
        key = varint()
        num, wt = key >> 3, key & 7
        if wt == 0:
            val: Any = varint()
        elif wt == 2:
            n = varint()
            val = msg[i:i + n]
            i += n
        elif wt == 1:
            val, i = msg[i:i + 8], i + 8
        elif wt == 5:
            val, i = msg[i:i + 4], i + 4
        else:
            raise AssertionError(f"unexpected wire type {wt}")
        out.append((num, wt, val, msg[start:i]))
    return out


def _fs_usage(resp: bytes) -> list[tuple[int, bytes]]:
    """ImageFsInfoResponse: each FilesystemUsage as (timestamp, the bytes of every other field)."""
    out = []
    for num, _, usage, _ in _wire(resp):
        fields = _wire(usage)
        ts = next((v for n, _, v, _ in fields if n == 1), 0)
        out.append((ts, b"".join(raw for n, _, _, raw in fields if n != 1)))
    return out


def test_image_fs_info_and_container_events_pass_through(agent: Bed) -> None:
    direct = agent.endpoint
    # ImageFsInfo: what containerd answers, unchanged. containerd stamps each answer with the time,
    # so the one through the agent, taken between two direct ones, lies between them and is
    # otherwise the same bytes (retried across containerd's periodic usage refresh).
    for _ in range(10):
        a = raw_call(direct, "/runtime.v1.ImageService/ImageFsInfo", b"")
        b = raw_call(agent.cri_endpoint, "/runtime.v1.ImageService/ImageFsInfo", b"")
        c = raw_call(direct, "/runtime.v1.ImageService/ImageFsInfo", b"")
        ua, ub, uc = _fs_usage(a), _fs_usage(b), _fs_usage(c)
        if [r for _, r in ua] == [r for _, r in uc]:
            assert [r for _, r in ub] == [r for _, r in ua]
            assert all(ta <= tb <= tc for (ta, _), (tb, _), (tc, _) in zip(ua, ub, uc))
            if a == c:
                assert b == a
            break
    else:
        raise AssertionError("containerd's ImageFsInfo never held still")
    assert ua and ua[0][1], "ImageFsInfo returned no filesystem"

    # GetContainerEvents: what containerd streams arrives through the endpoint unchanged.
    async def go() -> None:
        async with grpc.aio.insecure_channel(grpc_target(direct)) as dch, \
                grpc.aio.insecure_channel(grpc_target(agent.cri_endpoint)) as ach:
            ds = dch.unary_stream(RT + "GetContainerEvents")(b"", timeout=120)
            as_ = ach.unary_stream(RT + "GetContainerEvents")(b"", timeout=120)
            got: dict[str, list[bytes]] = {"direct": [], "agent": []}

            async def drain(name: str, stream: Any) -> grpc.aio.AioRpcError | None:
                try:
                    async for m in stream:
                        got[name].append(m)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        return exc
                return None

            tasks = [asyncio.create_task(drain("direct", ds)), asyncio.create_task(drain("agent", as_))]
            # Both streams are open before the pod is made, and its sandbox is made before the container.
            pod = await asyncio.to_thread(pod_via_agent, agent, "e2e-cri-events", [shell(agent)])
            try:
                cid = pod.containers["shell"].encode()

                def seen(name: str) -> list[bytes]:
                    return [m for m in got[name] if _fields(m).get(1) == cid]

                # Until the container's events have come through both, or the runtime ended the stream.
                for _ in range(200):
                    if tasks[0].done() or (len(seen("direct")) >= 2 and len(seen("agent")) >= len(seen("direct"))):
                        break
                    await asyncio.sleep(0.05)
                if tasks[0].done():
                    # A runtime without the event stream (containerd 1.6): its status passes through as is.
                    d_err, a_err = await tasks[0], await tasks[1]
                    assert d_err is not None and a_err is not None
                    assert (a_err.code(), a_err.details()) == (d_err.code(), d_err.details())
                    return
                d, a = seen("direct"), seen("agent")
                assert d, "containerd streamed no event for the new container"
                # The same events, in the same order (type and time), for the same actions.
                assert [(_fields(m).get(2, 0), _fields(m).get(3)) for m in a][:len(d)] == \
                    [(_fields(m).get(2, 0), _fields(m).get(3)) for m in d]
            finally:
                ds.cancel()
                as_.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.to_thread(remove_pod, agent, pod.id)

    asyncio.run(go())


@pytest.mark.also17
def test_a_pod_annotated_restore_from_comes_up_restored(agent: Bed) -> None:
    src = pod_via_agent(agent, "e2e-cri", [shell(agent)])
    new: PodHandle | None = None
    try:
        log = os.path.join(src.log_dir, "shell", "0.log")
        wait_for(lambda: len(ticks(log)) >= 5, what="source ticks")
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        at_checkpoint = max(ticks(log))

        # A kubelet creates the pod: RunPodSandbox, CreateContainer, StartContainer, all through the endpoint.
        # The agent restarts between the sandbox and its container: the mapping survives. Into another
        # namespace than the checkpoint's, as the node's config lets it (restore.pod-sources).
        agent.stop_agent()
        config = Path(agent.config)
        original = config.read_text()
        config.write_text(original + "restore:\n  pod-sources:\n    e2e-cri-kubelet: [e2e-cri]\n")
        agent.start_agent()
        try:
            new = pod_via_agent(agent, "e2e-cri-kubelet", [], annotations={RESTORE_FROM: ckpt})
        finally:
            config.write_text(original)
        pd = via_agent(agent, lambda c: c.pod_status(new.id))
        assert pd.pod.runtime_handler == agent.handler
        agent.stop_agent()
        agent.start_agent()
        pcfg = dict(pd.config)
        ccfg = shell(agent)
        os.makedirs(os.path.join(pcfg["log_directory"], "shell"), exist_ok=True)

        async def create(client: CriClient) -> str:
            cid = await client.create_container(new.id, ccfg, pcfg)
            await client.start_container(cid)
            return cid

        new.containers["shell"] = via_agent(agent, create)
        d = container_detail(agent, new.containers["shell"])
        assert d.container.state == "CONTAINER_RUNNING"
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="restored ticks")
        first = ticks(d.log_path)[0]
        assert first > 5 and first >= at_checkpoint - 1, f"the counter restarted: first tick {first}"

        # The kubelet removes the pod through the endpoint; the agent forgets it.
        state = Path(agent.store) / "cri-restores" / new.id
        assert state.is_dir()

        async def remove(client: CriClient) -> None:
            await client.stop_pod(new.id)
            await client.remove_pod(new.id)

        via_agent(agent, remove)
        assert not state.exists()
        new = None
    finally:
        remove_pod(agent, src.id)
        if new is not None:
            remove_pod(agent, new.id)


def test_restore_from_a_missing_checkpoint_fails_the_sandbox_clearly(agent: Bed) -> None:
    missing = "sha256:" + "ab" * 32
    name = f"p-{secrets.token_hex(3)}"
    pcfg = pod_config(agent, "e2e-cri-missing", name)
    pcfg["annotations"] = {RESTORE_FROM: missing}

    async def go(client: CriClient) -> None:
        with pytest.raises(Exception) as info:
            await client.run_pod(pcfg, "")
        assert missing in str(info.value) and "not in this node's store" in str(info.value)
        assert info.value.__class__.__name__ == "FailedPrecondition"
        assert not [p for p in await client.list_pods() if p.namespace == "e2e-cri-missing"]

    via_agent(agent, go)
    assert uuid.UUID(pcfg["metadata"]["uid"])



def test_container_events_stream_through_byte_for_byte(bed17: tuple[Bed, EventTap]) -> None:
    """containerd 1.7 streams container events; the agent's endpoint relays the same messages, byte for byte.

    containerd 1.7 gives each event to one of the streams open at the time (not to each), so the
    stream against containerd is the one the agent opens, seen through the recording EventTap between
    the two: what containerd sent on it, and what the client got through the agent, must be equal.
    """
    bed, tap = bed17
    assert bed.info["containerd_version"].startswith("1.7"), bed.info
    method = RT + "GetContainerEvents"

    async def go() -> tuple[list[bytes], list[bytes], bytes, bytes]:
        async with grpc.aio.insecure_channel(grpc_target(bed.cri_endpoint)) as ach:
            before = tap.stream_count()
            # Raw bytes: nothing is decoded or re-encoded on this side either.
            stream = ach.unary_stream(method, request_serializer=None, response_deserializer=None)(b"", timeout=180)
            got: list[bytes] = []

            async def drain() -> grpc.aio.AioRpcError | None:
                try:
                    async for m in stream:
                        got.append(m)
                except asyncio.CancelledError:  # cancelled from this side: the end of the test
                    pass
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        return exc
                return None

            task = asyncio.create_task(drain())
            for _ in range(200):
                if tap.stream_count() > before or task.done():
                    break
                await asyncio.sleep(0.05)
            assert not task.done(), f"the event stream through the agent ended at once: {task.result()!r}"
            assert tap.stream_count() == before + 1, "the agent opened no event stream against containerd"

            async def until(want: Callable[[], bool], what: str) -> None:
                for _ in range(400):
                    if want():
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"timed out waiting for {what}; got {brief(got)}")

            pod = await asyncio.to_thread(pod_via_agent, bed, "e2e-cri-events17", [shell(bed)])
            removed = False
            try:
                cid = pod.containers["shell"].encode()
                await until(lambda: sum(_fields(m).get(1) == cid for m in got) >= 2,
                            "created and started events of the container")
                await asyncio.to_thread(remove_pod, bed, pod.id)
                removed = True
                await until(lambda: any(_fields(m).get(1) == cid and _fields(m).get(2) == 3 for m in got),
                            "the container's deleted event")
                await asyncio.sleep(1.0)  # anything late arrives too
            finally:
                stream.cancel()
                error = await task
                if not removed:
                    await asyncio.to_thread(remove_pod, bed, pod.id)
            assert error is None, error
            return tap.stream(before), got, cid, pod.id.encode()

    direct, relayed, cid, pod_id = asyncio.run(go())
    assert direct, "containerd 1.7 streamed no container event"
    assert relayed == direct, f"the agent relayed {brief(relayed)}, containerd streamed {brief(direct)}"
    # ContainerEventResponse: container_id = 1, container_event_type = 2, created_at = 3.
    fields = [_fields(m) for m in direct]
    assert all(isinstance(f.get(1), bytes) and f[1] for f in fields), fields
    assert {cid, pod_id} <= {f[1] for f in fields}, brief(direct)
    mine = [f.get(2, 0) for f in fields if f[1] == cid]
    # CONTAINER_CREATED_EVENT (0), CONTAINER_STARTED_EVENT (1), ..., CONTAINER_DELETED_EVENT (3)
    assert mine[:2] == [0, 1] and mine[-1] == 3, mine
    stamps = [f.get(3, 0) for f in fields]
    assert stamps == sorted(stamps) and stamps[0] > 0, stamps


def brief(messages: list[bytes]) -> list[tuple[str, int]]:
    """ContainerEventResponses as (container id prefix, event type)."""
    return [(_fields(m).get(1, b"")[:12].decode(errors="replace"), _fields(m).get(2, 0)) for m in messages]


def test_the_cri_endpoint_serves_health_and_reflection(agent: Bed) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(agent.cri_endpoint) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="runtime.v1.RuntimeService"), timeout=10
        ).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"runtime.v1.RuntimeService", "runtime.v1.ImageService", "grpc.health.v1.Health"} <= names
