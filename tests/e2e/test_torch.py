"""A PyTorch model server from Debian's packages, checkpointed while it serves and restored into other namespaces.

The torch image (scripts/testbed up --images torch; docs/testbed.md) holds Debian's python3-torch with
OpenBLAS and `torchserver`: it imports torch, loads 512 MiB of seeded weights saved as .npy when the
image was built into 128 linear layers of their own (load_state_dict from torch.from_numpy), traces the
model, warms up and serves over HTTP. It is checkpointed while a client keeps asking it, then restored
into another namespace twice: by default (lazily, pages streamed in while it runs) and with `--full`
(every page in, its weights resident, before the restore returns).
Each restore must be the same process by its own account (its recorded start, its PID), hold the same
parameters (their digest computed again from its memory), give the same answer for the same input,
count on from the source's requests, and serve again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.bed import Bed, PodHandle, container_detail, make_pod, pod_detail, remove_pod, wait_for
from tests.e2e.test_native_import import CONTAINER, namespaced
from tests.e2e.test_workloads import (
    _answering,
    _checkpoint_while_serving,
    _get,
    _get_json,
    _processes,
    _same_processes,
)

PORT = 8080
WEIGHTS = "/opt/torchmodel/weights.npy"
LAYERS = 128  # testbed/debian.py's TORCH_MIB of 1024 x 1024 float32 layers


def _predict(ip: str, x: float) -> dict[str, Any]:
    return _get_json(ip, f"/predict?x={x}", timeout=60)


def _idle_count(ip: str) -> int:
    """The /predict answers counted once no request is being worked on: a request the client had in flight
    at the checkpoint is finished by each copy too, at its own pace."""
    def idle() -> int | None:
        doc = _get_json(ip, "/count")
        return None if doc["handling"] else int(doc["requests"])

    return int(wait_for(idle, timeout=120, what="the requests in flight to finish"))


def _rss_anon(pid: int) -> int:
    """Bytes of anonymous memory resident in process `pid` (/proc/PID/status, RssAnon)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:"))
    return kib << 10


def _digest(ip: str) -> str:
    return str(_get_json(ip, "/digest", timeout=60)["params_sha256"])


def _file_digest(pid: int) -> str:
    """The sha256 of the weights file's data (after its .npy header), read through the container's root."""
    with open(f"/proc/{pid}/root{WEIGHTS}", "rb") as fh:
        head = fh.read(10)
        fh.seek(10 + int.from_bytes(head[8:10], "little"))
        h = hashlib.sha256()
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture
def things(torchbed: Bed) -> Iterator[list[str]]:
    """Pod IDs and checkpoint IDs (sha256:...) to remove after the test."""
    out: list[str] = []
    yield out
    for thing in reversed(out):
        if thing.startswith("sha256:"):
            torchbed.cli("checkpoints", "rm", thing, check=False)
        else:
            remove_pod(torchbed, thing)


def test_the_torch_server_restores_lazily_and_in_full_as_the_same_process(torchbed: Bed,
                                                                           things: list[str]) -> None:
    assert torchbed.info["containerd_version"].startswith("2."), torchbed.info["containerd_version"]
    image = torchbed.info["images"]["torch"]
    src: PodHandle = make_pod(torchbed, "e2e-torch", [
        namespaced("app", image, ["/usr/local/bin/torchserver", "--weights", WEIGHTS, "--port", str(PORT)],
                   CONTAINER)])
    things.append(src.id)
    ip = pod_detail(torchbed, src.id).ip
    wait_for(_answering(lambda: _get(ip, "/healthz") == b"ok"), timeout=300, what="the torch server to answer")
    xs = (1.0, 2.5, 7.0)
    before = {x: _predict(ip, x) for x in xs}
    ref = before[xs[0]]
    assert ref["pid"] == 1 and ref["layers"] == LAYERS and ref["params_bytes"] == LAYERS << 22, ref
    params = _file_digest(container_detail(torchbed, src.containers["app"]).pid)
    assert _digest(ip) == params
    assert all(_predict(ip, x)["answer"] == before[x]["answer"] for x in xs), "one process, one answer per input"
    procs = _processes(torchbed, src.containers["app"])
    assert len(procs) == 1, procs

    inputs = itertools.cycle(xs)
    ckpt = _checkpoint_while_serving(torchbed, src, lambda: _predict(ip, next(inputs)))
    things.append(ckpt)
    seen = _predict(ip, xs[1])["requests"]  # the source's count goes on; each copy counts on from the checkpoint's
    for namespace, flags in (("e2e-torch-lazy", []), ("e2e-torch-full", ["--full"])):
        out = torchbed.cli("restore", ckpt, "--namespace", namespace, "--start", *flags).stdout.split()
        pod_id, cid = out[0], out[2]
        things.append(pod_id)
        detail = container_detail(torchbed, cid)
        assert detail.container.state == "CONTAINER_RUNNING"
        with open(os.path.join(torchbed.store, "plans", cid, "plan.json"), encoding="utf-8") as fh:
            plan = json.load(fh)
        # Both through the page source; the full one lets the processes run once every page is in.
        assert (plan["lazy"], plan["filled"]) == (True, bool(flags)), plan
        if flags:  # so it returns with the weights resident, before any request
            assert _rss_anon(detail.pid) >= LAYERS << 22, (namespace, _rss_anon(detail.pid))
        new_ip = pod_detail(torchbed, pod_id).ip
        first = wait_for(_answering(lambda: _predict(new_ip, xs[0])), timeout=120,
                         what=f"the torch server restored {' '.join(flags) or 'by default'}")
        assert (first["started"], first["pid"]) == (ref["started"], ref["pid"]), (namespace, ref, first)
        counted = _idle_count(new_ip)
        assert ref["requests"] < first["requests"] <= counted <= seen, (namespace, ref, first, counted, seen)
        for x in xs:
            assert _predict(new_ip, x)["answer"] == before[x]["answer"], (namespace, x)
        assert _digest(new_ip) == params, namespace
        _same_processes(torchbed, cid, procs)
        after = _predict(new_ip, xs[2])
        assert after["requests"] == counted + len(xs) + 1 and after["answer"] == before[xs[2]]["answer"]
        remove_pod(torchbed, pod_id)
        things.remove(pod_id)
    # The source goes on.
    assert _predict(ip, xs[1])["answer"] == before[xs[1]]["answer"]
