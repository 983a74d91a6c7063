"""The page source started ahead of its restore (node_agent.lazy.spare), with real processes and userfaultfds."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
from collections.abc import AsyncIterator

import pytest

from criu_bridge.watchdog import proc_argv
from node_agent.lazy import background, strays
from node_agent.lazy.spare import Spare, receive
from test_lazy_failures import PAGES, Pod, _pages


@pytest.fixture
async def pod() -> AsyncIterator[Pod]:
    p = Pod()
    try:
        yield p
    finally:
        await p.close()


async def _spare_up(spare: Spare, other_than: int = 0) -> int:
    """The pid of the spare once it is started (a new one, other than ``other_than``)."""
    async with asyncio.timeout(30):
        while spare._proc is None or spare._proc.pid == other_than:
            await asyncio.sleep(0.01)
    return spare._proc.pid


def _autogroup_nice(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/autogroup", encoding="ascii") as fh:
            return int(fh.read().rsplit("nice", 1)[1])
    except (FileNotFoundError, IndexError, ValueError):
        return None  # a kernel without autogroup


async def test_the_spare_becomes_the_restores_page_source_and_a_new_one_waits(pod: Pod) -> None:
    pod.lazy.spare.prepare()
    first = await _spare_up(pod.lazy.spare)
    # Waiting, it takes only CPU nobody else wants.
    assert os.sched_getscheduler(first) == os.SCHED_IDLE
    assert os.getpriority(os.PRIO_PROCESS, first) == background.IDLE_NICE
    assert _autogroup_nice(first) in (None, background.IDLE_NICE)

    pod.lazy_process("app")
    memory = _pages(3)
    ckpt = pod.checkpoint({"app": memory})
    pod.record("app", ckpt, True)
    session = await pod.start("app", ckpt)
    source = session._source
    assert source is not None and source.pid == first
    second = await _spare_up(pod.lazy.spare, other_than=first)
    assert second != first
    work = pod.plan("app") / "work"
    # It logs where a new source would, and is out of the idle class, at a lazy source's background priority.
    async with asyncio.timeout(30):
        while "ready:" not in (work / "page-source.log").read_text():
            await asyncio.sleep(0.01)
    # It shows the source's command line, so that ps and a later agent (strays) see which plan it serves.
    argv = proc_argv(first)
    assert argv[1:3] == ["-m", "node_agent.lazy.source"] and "--room" not in argv
    assert argv[argv.index("--images") + 1] == str(pod.plan("app") / "images")
    assert [(h.pid, h.kind, h.container_id) for h in strays.helpers(pod.settings.plans_dir)
            if h.pid == first] == [(first, "page-source", pod.cid("app"))]
    assert os.sched_getscheduler(first) == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, first) == max(background.NICE, os.getpriority(os.PRIO_PROCESS, 0))
    assert _autogroup_nice(first) in (None, background.NICE)
    await pod.connect("app")
    assert pod.ask("app", f"hash 0 {PAGES}") == hashlib.sha256(memory).hexdigest()
    async with asyncio.timeout(60):
        outcome = await session.wait()
        assert await source.wait() == 0
    assert outcome.ok and outcome.pages == PAGES
    assert json.loads((pod.plan("app") / "lazy.done").read_text())["pages"] == PAGES
    spare = pod.lazy.spare._proc
    assert spare is not None and spare.pid == second
    await pod.lazy.shutdown()
    assert spare.returncode is not None  # it ended with the agent's lazy restores


async def test_a_spare_that_died_is_replaced_by_a_new_source(pod: Pod) -> None:
    pod.lazy.spare.prepare()
    first = await _spare_up(pod.lazy.spare)
    os.kill(first, 9)
    assert pod.lazy.spare._proc is not None and await pod.lazy.spare._proc.wait() == -9
    pod.lazy_process("app")
    memory = _pages(4)
    ckpt = pod.checkpoint({"app": memory})
    pod.record("app", ckpt, True)
    session = await pod.start("app", ckpt)
    assert session._source is not None and session._source.pid != first
    await pod.connect("app")
    assert pod.ask("app", f"hash 0 {PAGES}") == hashlib.sha256(memory).hexdigest()
    async with asyncio.timeout(60):
        assert (await session.wait()).ok


def test_a_job_is_mapped_to_the_descriptors_received_and_a_malformed_one_refused() -> None:
    def sent(doc: object, fds: list[int]) -> tuple[list[str], int] | None:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            socket.send_fds(ours, [(json.dumps(doc) + "\n").encode()], fds)
            return receive(theirs)

    a, b = os.pipe()
    try:
        argv, stderr = sent({"argv": ["--listen-fd", str(a), "--hold-fd", "-1", "--x", "7"], "fds": [a]}, [a, b])
        listen = int(argv[1])
        assert argv[2:] == ["--hold-fd", "-1", "--x", "7"] and listen not in (a, b)
        assert os.path.sameopenfile(listen, a) and os.path.sameopenfile(stderr, b)
        os.close(listen)
        os.close(stderr)
        before = sorted(os.listdir("/proc/self/fd"))
        for doc, fds in (
            ({"argv": ["--listen-fd", "99"], "fds": [a]}, [a, b]),  # names a descriptor not sent
            ({"argv": ["--listen-fd", str(a)], "fds": [a]}, [a]),  # no standard error
            ({"argv": "--listen-fd", "fds": []}, [b]),
            (["--listen-fd"], [b]),  # not an object
        ):
            with pytest.raises(ValueError):
                sent(doc, fds)
        assert sorted(os.listdir("/proc/self/fd")) == before  # what came with a refused job is closed
        ours, theirs = socket.socketpair()
        ours.close()
        with theirs:
            assert receive(theirs) is None  # the agent let go
    finally:
        os.close(a)
        os.close(b)


async def test_no_spare_is_kept_where_restores_cannot_go_through_a_page_source(
        pod: Pod, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("node_agent.lazy.restores.lazy_restore_support", lambda criu, timeout: (False, "no uffd"))
    pod.lazy.prepare()
    first = await _spare_up(pod.lazy.spare)
    proc = pod.lazy.spare._proc
    assert proc is not None and proc.pid == first
    assert await pod.lazy.supported() == (False, "no uffd")  # the first restore asks
    assert proc.returncode is not None and pod.lazy.spare.pid is None
    pod.lazy.prepare()  # asked again (the agent restarted its lazy restores): still none
    starting = pod.lazy.spare._starting
    assert pod.lazy.spare.pid is None and (starting is None or starting.done())
