"""A real node for the end-to-end tests: private containerd, runc, CRIU.

Never skipped: without root or a working test bed these tests fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.bed import Bed, bring_up, testbed

BED_NAME = os.environ.get("NODE_AGENT_E2E_BED", "na-e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    assert os.geteuid() == 0, "the end-to-end tests need root (they run a private containerd)"
    workdir = tmp_path_factory.mktemp("bed")
    b = bring_up(BED_NAME, workdir)
    b.start_agent()
    try:
        yield b
    finally:
        b.stop_agent()
        if os.environ.get("NODE_AGENT_E2E_KEEP") != "1":
            testbed("down", BED_NAME)


@pytest.fixture
def agent(bed: Bed) -> Iterator[Bed]:
    """The bed with its agent running (restarted if a test killed it)."""
    if bed.agent is None or bed.agent.poll() is not None:
        bed.start_agent()
    yield bed
    if bed.agent is None or bed.agent.poll() is not None:
        bed.start_agent()


@pytest.fixture(scope="session")
def node2(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """A second "node": its own containerd, runc root, CNI bridge, images, and an agent with an empty store."""
    name = BED_NAME + "-2"
    b = bring_up(name, tmp_path_factory.mktemp("node2"))
    assert b.info["subnet"] != bed.info["subnet"] and b.info["cni_bridge"] != bed.info["cni_bridge"]
    b.start_agent()
    try:
        yield b
    finally:
        b.stop_agent()
        if os.environ.get("NODE_AGENT_E2E_KEEP") != "1":
            testbed("down", name)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real OCI registry (Debian's docker-registry) on loopback, with basic auth."""
    from tests.registry_server import Registry

    with Registry(tmp_path_factory.mktemp("registry"), users={"ops": "s3cret"}) as reg:
        yield reg
