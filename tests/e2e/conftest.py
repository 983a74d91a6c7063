"""A real node for the end-to-end tests: private containerd, runc, CRIU.

Never skipped: without root or a working test bed these tests fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from testbed.bed import CONTAINERD17, Bed, bring_up, reconfigured, testbed
from tests.e2e.tap import EventTap

BED_NAME = os.environ.get("NODE_AGENT_E2E_BED", "na-e2e")
# containerd 1.7 from its private prefix (scripts/install-host).


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked `also17` get the `agent` on containerd 2.1 and, again, on 1.7."""
    if "agent" in metafunc.fixturenames and metafunc.definition.get_closest_marker("also17"):
        metafunc.parametrize("agent", ["containerd-2.1", "containerd-1.7"], indirect=True)


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
def agent(request: pytest.FixtureRequest) -> Iterator[Bed]:
    """The bed (containerd 2.1; 1.7 for the second run of an `also17` test) with its agent running
    (restarted if a test killed it)."""
    bed: Bed = request.getfixturevalue("bed17")[0] if getattr(request, "param", "") == "containerd-1.7" \
        else request.getfixturevalue("bed")
    if bed.agent is None or bed.agent.poll() is not None:
        bed.start_agent()
    yield bed
    if bed.agent is None or bed.agent.poll() is not None:
        bed.start_agent()


@pytest.fixture
def allow_foreign(agent: Bed) -> Iterator[Bed]:
    """The agent with `restore: {allow-foreign: true}`, for tests that restore other engines' archives
    (refused by default)."""
    with reconfigured(agent, "restore:\n  allow-foreign: true\n"):
        yield agent


def _second_bed(suffix: str, workdir: Path, images: str | None = None) -> Iterator[Bed]:
    b = bring_up(BED_NAME + suffix, workdir, images=images)
    b.start_agent()
    try:
        yield b
    finally:
        b.stop_agent()
        if os.environ.get("NODE_AGENT_E2E_KEEP") != "1":
            testbed("down", BED_NAME + suffix)


@pytest.fixture(scope="session")
def node2(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """A second "node": its own containerd, runc root, CNI bridge, images, and an agent with an empty store."""
    for b in _second_bed("-2", tmp_path_factory.mktemp("node2")):
        assert b.info["subnet"] != bed.info["subnet"] and b.info["cni_bridge"] != bed.info["cni_bridge"]
        yield b


@pytest.fixture(scope="session")
def node3(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """A third "node", like node2."""
    yield from _second_bed("-3", tmp_path_factory.mktemp("node3"))


@pytest.fixture(scope="session")
def torchbed(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """A node with the torch image (Debian's PyTorch and the torch server) and an agent of its own."""
    yield from _second_bed("-torch", tmp_path_factory.mktemp("torch"), images="pause,torch")


@pytest.fixture(scope="session")
def fresh(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """A fresh node: no image but the sandbox's, an empty store; it reaches registries only as a test
    configures it to (its hosts.toml, its logins)."""
    yield from _second_bed("-fresh", tmp_path_factory.mktemp("fresh"), images="pause")


@pytest.fixture(scope="session")
def misbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """A bed whose restore handler was set up for another store than its agent's (a mismatched node)."""
    name = BED_NAME + "-mis"
    workdir = tmp_path_factory.mktemp("misbed")
    b = bring_up(name, workdir, handler_store=str(workdir / "other-store"))
    b.start_agent()
    try:
        yield b
    finally:
        b.stop_agent()
        if os.environ.get("NODE_AGENT_E2E_KEEP") != "1":
            testbed("down", name)


@pytest.fixture(scope="session")
def bed17(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Bed, EventTap]]:
    """A bed running containerd 1.7 (which streams container events), with an agent and its CRI endpoint.
    The agent reaches containerd through an EventTap, which keeps what containerd streamed to it."""
    assert os.geteuid() == 0, "the end-to-end tests need root (they run a private containerd)"
    assert os.access(CONTAINERD17, os.X_OK), f"{CONTAINERD17} missing: run scripts/install-host"
    name = BED_NAME + "-17"
    workdir = tmp_path_factory.mktemp("bed17")
    b = bring_up(name, workdir, containerd=CONTAINERD17)
    try:
        assert b.info["containerd_version"].startswith("1.7"), b.info
        with EventTap(str(workdir / "tap.sock"), b.info["containerd_socket"]) as tap:
            config = Path(b.config)
            text = config.read_text()
            assert f"cri-endpoint: {b.endpoint}\n" in text, text
            config.write_text(text.replace(f"cri-endpoint: {b.endpoint}\n", f"cri-endpoint: {tap.endpoint}\n"))
            try:
                b.start_agent()
                yield b, tap
            finally:
                b.stop_agent()
    finally:
        if os.environ.get("NODE_AGENT_E2E_KEEP") != "1":
            testbed("down", name)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real OCI registry (Debian's docker-registry) on loopback, with basic auth."""
    from testbed.registry import Registry

    with Registry(tmp_path_factory.mktemp("registry"), users={"ops": "s3cret"}) as reg:
        yield reg
