"""Lazy restore: containers run before their memory is read; pages come from the store on demand."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import Iterator

import pytest

from testbed.bed import (
    Bed, PodHandle, answers, ask, container_config, container_detail, lazy_helpers, make_pod, pod_detail, remove_pod,
    wait_for,
)


def _memhog_pod(bed: Bed, namespace: str, mib: int, seed: int = 1) -> PodHandle:
    imgs = bed.info["images"]
    return make_pod(bed, namespace, [container_config("mem", imgs["memhog"], [
        "/usr/local/bin/memhog", "--mib", str(mib), "--port", "8080", "--interval-ms", "100", "--flip", "0",
        "--seed", str(seed),
    ])])


def _sum(reply: str) -> str:
    fields = dict(f.split("=", 1) for f in reply.split())
    return fields["sum"]


def _lazy_processes(cid: str) -> list[str]:
    """"PID ARGS" of the page source (or an older agent's lazy-pages daemon) of container ``cid``."""
    return lazy_helpers(f"/plans/{cid}/")


def _plans(bed: Bed) -> str:
    return os.path.join(bed.store, "plans")


@pytest.fixture
def checkpointed(agent: Bed, request: pytest.FixtureRequest) -> Iterator[tuple[PodHandle, str, str]]:
    mib = getattr(request, "param", 64)
    pod = _memhog_pod(agent, "e2e-lazy", mib)
    try:
        ip = pod_detail(agent, pod.id).ip
        wait_for(lambda: answers(ip), what="memhog to answer")
        before = _sum(ask(ip))
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        yield pod, ckpt, before
        agent.cli("checkpoints", "rm", ckpt, check=False)
    finally:
        remove_pod(agent, pod.id)


@pytest.mark.also17
def test_a_lazily_restored_workload_has_the_same_memory(agent: Bed, checkpointed: tuple[PodHandle, str, str]) -> None:
    _pod, ckpt, before = checkpointed
    out = agent.cli("restore", ckpt, "--namespace", "e2e-lazy-dst", "--lazy", "--start").stdout.split()
    new_pod, cid = out[0], out[2]
    try:
        plan = os.path.join(_plans(agent), cid)
        with open(os.path.join(plan, "plan.json"), encoding="utf-8") as fh:
            assert json.load(fh)["lazy"] is True
        # The pages file was staged sparse: the lazy pages never left the store.
        assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
        ip = pod_detail(agent, new_pod).ip
        assert _sum(ask(ip)) == before
        done = wait_for(lambda: os.path.exists(os.path.join(plan, "lazy.done")), timeout=60, what="every page in")
        assert done
        with open(os.path.join(plan, "lazy.done"), encoding="utf-8") as fh:
            done_doc = json.load(fh)
        assert done_doc["pages"] == done_doc["total"] > 64 * 256 * 0.9
        # The background machinery is gone once every page is in.
        wait_for(lambda: not _lazy_processes(cid), timeout=15, what="the page source to exit")
        wait_for(lambda: not os.path.exists(os.path.join(plan, "images")), timeout=15, what="the images to go")
        assert not os.path.exists(os.path.join(plan, "work", "lazy-pages.socket"))
        assert _sum(ask(ip)) == before
        assert "all" in agent.tail_log(200) and "lazy pages in" in agent.tail_log(200)
    finally:
        remove_pod(agent, new_pod)


def _restore_state(agent: Bed, cid: str, states: tuple[str, ...]) -> dict[str, str] | None:
    """The container's line of `restores` once its state is one of `states`."""
    for rep in json.loads(agent.cli("restores", "-o", "json").stdout):
        if rep["container_id"] == cid and rep["state"] in states:
            return {"state": rep["state"], "reason": rep.get("reason", "")}
    return None


@pytest.mark.parametrize("checkpointed", [384], indirect=True)
def test_a_page_source_killed_mid_restore_kills_the_container_and_says_so(
    agent: Bed, checkpointed: tuple[PodHandle, str, str]
) -> None:
    _pod, ckpt, _before = checkpointed
    for _attempt in range(3):
        out = agent.cli("restore", ckpt, "--namespace", "e2e-lazy-kill", "--lazy").stdout.split()
        new_pod, cid = out[0], out[2]
        try:
            source = wait_for(lambda: [ln for ln in _lazy_processes(cid) if "lazy.source" in ln], what="the source")
            pid = int(source[0].split()[0])
            # Start the container, and kill the page source while its pages stream in.
            agent.cri(lambda cri: cri.start_container(cid))
            os.kill(pid, signal.SIGKILL)
            # What the node's user sees (`restores`). The plan itself is no witness: the runtime deletes a
            # killed container's task, and with it the plan, at a moment of its own.
            rep = wait_for(lambda: _restore_state(agent, cid, ("failed", "done")), timeout=30,
                           what="the restore to end, failed or done")
            if rep["state"] == "done":
                continue  # every page was in before the kill: try again
            assert "killed by signal 9" in rep["reason"], rep
            logged = [ln for ln in agent.tail_log(300).splitlines() if "phase lazy-pages" in ln]
            assert logged and "e2e-lazy-kill/" in logged[-1] and "container mem" in logged[-1], logged
            assert rep["reason"] in logged[-1] and "the container was killed" in logged[-1], logged[-1]
            wait_for(lambda: container_detail(agent, cid).container.state == "CONTAINER_EXITED", timeout=30,
                     what="the container to be dead")
            wait_for(lambda: not _lazy_processes(cid), timeout=15, what="the page source to go")
            # The agent goes on serving.
            assert ckpt[:19] in agent.cli("checkpoints", "ls").stdout
            return
        finally:
            remove_pod(agent, new_pod)
    pytest.fail("the transfer finished before the page source could be killed, three times")


def test_without_lazy_support_restore_falls_back_and_says_so_once(
    agent: Bed, checkpointed: tuple[PodHandle, str, str], tmp_path: object
) -> None:
    _pod, ckpt, before = checkpointed
    fake = os.path.join(str(tmp_path), "criu-without-uffd")
    real = subprocess.run(["sh", "-c", "command -v criu"], capture_output=True, text=True).stdout.strip()
    with open(fake, "w", encoding="utf-8") as fh:
        fh.write("#!/bin/sh\n"
                 "# A CRIU whose kernel lacks userfaultfd: the lazy-pages check fails.\n"
                 'case "$*" in *uffd-noncoop*) echo "UFFD is not supported" >&2; exit 1;; esac\n'
                 f'exec {real} "$@"\n')
    os.chmod(fake, stat.S_IRWXU)
    with open(agent.config, encoding="utf-8") as fh:
        original = fh.read()
    agent.stop_agent()
    try:
        with open(agent.config, "a", encoding="utf-8") as fh:
            fh.write(f"\ncriu: {fake}\n")
        agent.start_agent()
        for i in range(2):
            out = agent.cli("restore", ckpt, "--namespace", f"e2e-lazy-off{i}", "--lazy", "--start").stdout.split()
            try:
                with open(os.path.join(_plans(agent), out[2], "plan.json"), encoding="utf-8") as fh:
                    assert json.load(fh)["lazy"] is False
                assert _sum(ask(pod_detail(agent, out[0]).ip)) == before
            finally:
                remove_pod(agent, out[0])
        assert agent.tail_log(400).count("lazy restore is not available here") == 1
    finally:
        agent.stop_agent()
        with open(agent.config, "w", encoding="utf-8") as fh:
            fh.write(original)
        agent.start_agent()
