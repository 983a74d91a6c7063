"""Lazy restore at the edges: the pod removed, the agent killed or the checkpoint removed while its pages stream in."""

from __future__ import annotations

import os
import signal

from testbed.bed import Bed, answers, ask, container_detail, pod_detail, remove_pod, wait_for
from tests.e2e.test_lazy import _lazy_processes, _memhog_pod, _sum


def _checkpoint(agent: Bed, mib: int) -> tuple[str, str, str]:
    pod = _memhog_pod(agent, "e2e-lazy-edge", mib)
    ip = pod_detail(agent, pod.id).ip
    wait_for(lambda: answers(ip), what="memhog to answer")
    before = _sum(ask(ip))
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    return pod.id, ckpt, before


def test_a_pod_removed_mid_transfer_leaves_nothing_behind_and_no_error(agent: Bed) -> None:
    src, ckpt, _ = _checkpoint(agent, 512)
    try:
        out = agent.cli("restore", ckpt, "--namespace", "e2e-lazy-rm", "--lazy", "--start").stdout.split()
        cid = out[2]
        remove_pod(agent, out[0])
        wait_for(lambda: not _lazy_processes(cid), timeout=30, what="the daemon and the page source to go")
        log = [ln for ln in agent.tail_log(300).splitlines() if "e2e-lazy-rm/" in ln]
        assert not [ln for ln in log if " ERROR " in ln], log
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, src)


def test_the_pages_keep_coming_when_the_agent_dies_mid_transfer(agent: Bed) -> None:
    src, ckpt, before = _checkpoint(agent, 512)
    try:
        out = agent.cli("restore", ckpt, "--namespace", "e2e-lazy-agent", "--lazy", "--start").stdout.split()
        new_pod, cid = out[0], out[2]
        try:
            agent.kill_agent()
            assert _lazy_processes(cid), "the transfer was over before the agent died"
            # The page source serves on alone; the workload's memory is whole.
            ip = pod_detail(agent, new_pod).ip
            assert _sum(ask(ip, timeout=60)) == before
            wait_for(lambda: not _lazy_processes(cid), timeout=60, what="the transfer to end")
            assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
            agent.start_agent()
            assert _sum(ask(ip)) == before
        finally:
            if agent.agent is None or agent.agent.poll() is not None:
                agent.start_agent()
            remove_pod(agent, new_pod)
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, src)


def test_removing_the_checkpoint_mid_transfer_keeps_the_replica_whole(agent: Bed) -> None:
    src, ckpt, before = _checkpoint(agent, 512)
    manifest = os.path.join(agent.store, "blobs", "sha256", ckpt.split(":", 1)[1])
    removed = False
    try:
        out = agent.cli("restore", ckpt, "--namespace", "e2e-lazy-gone", "--lazy", "--start").stdout.split()
        new_pod, cid = out[0], out[2]
        try:
            sources = [int(p.split()[0]) for p in _lazy_processes(cid) if "lazy.source" in p]
            assert sources, "the transfer was over before the checkpoint could be removed"
            # Pause the transfer so that the removal surely falls inside it.
            os.kill(sources[0], signal.SIGSTOP)
            try:
                agent.cli("checkpoints", "rm", ckpt)
                removed = True
                agent.cli("gc")
                assert ckpt not in agent.cli("checkpoints", "ls").stdout
                assert os.path.exists(manifest), "the blobs went while a replica still reads them"
            finally:
                os.kill(sources[0], signal.SIGCONT)
            ip = pod_detail(agent, new_pod).ip
            assert _sum(ask(ip, timeout=60)) == before
            wait_for(lambda: not _lazy_processes(cid), timeout=60, what="the transfer to end")
            assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
            # The hold ended with the transfer: the next collection frees the blobs.
            assert not os.listdir(os.path.join(agent.store, "ingest"))
            agent.cli("gc")
            assert not os.path.exists(manifest)
            assert _sum(ask(ip)) == before
        finally:
            remove_pod(agent, new_pod)
    finally:
        if not removed:
            agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, src)
