"""A checkpoint cancelled while its pod is still freezing: the pod ends thawed.

Freezing a container waits until the kernel says every task is frozen, writing the freezer again as it
waits; it runs in a thread, which the cancelled call cannot stop. The thaw must come after it, or the
freeze still under way freezes the container again behind the thaw and nobody thaws it. The cgroup is the
fake v2 tree of test_checkpoint_space: the test says when the kernel has frozen it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from criu_bridge import freezer
from test_checkpoint_space import Node


def test_a_checkpoint_cancelled_while_its_pod_freezes_leaves_it_thawed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = tmp_path / "fs"
    fs.mkdir()
    node = Node(tmp_path, fs, monkeypatch, memory=1 << 20, min_free=0)
    events = node.cgroup / "cgroup.events"
    events.write_text("populated 1\nfrozen 0\n")  # the kernel is still freezing it
    thaws: list[str] = []
    real_thaw = freezer.thaw
    monkeypatch.setattr(freezer, "thaw", lambda f: (thaws.append(f.path), real_thaw(f)))

    async def go() -> None:
        task = asyncio.ensure_future(node.checkpoint())
        while not node.freezes:
            await asyncio.sleep(0.005)
        task.cancel()
        # The call ends only once its freeze has: until the kernel is done, nothing is thawed.
        done, _ = await asyncio.wait([task], timeout=1.0)
        assert not done and thaws == [], "thawed while the freeze was still under way"
        events.write_text("populated 1\nfrozen 1\n")  # the kernel has frozen every task
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert thaws, "never thawed"
    node.assert_left_nothing()
