"""A restore is real or it fails: the handler must serve this agent, a marked container never starts fresh,
and a checkpoint's configs get no host access on their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest

from criu_bridge.wrapper import PLAN_ANNOTATION
from node_agent import errors
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent.podformat import manifest_annotations
from node_agent.cri.client import _parse
from node_agent.store import Store
from testbed.bed import (
    Bed, container_config, container_detail, counter_pod, lazy_helpers, make_pod, pod_config, pods_in, remove_pod,
    reconfigured, start_refusal, ticks, volume_dir, wait_for,
)
from tests.e2e.test_cri_endpoint import RESTORE_FROM, RT, checkpoint_pod, pod_via_agent, raw_call, shell

# ---- a node whose handler serves another store -------------------------------------------


def _handler_refusal(text: str, bed: Bed) -> None:
    """The FAILED_PRECONDITION of a mismatched handler names all that is needed to fix it."""
    other = os.path.join(os.path.dirname(bed.store), "other-store")
    for needle in ("'criu'", f"{other}/bin/node-agent-runc", f"{other}/plans", f"{bed.store}/plans",
                   f"node-agent containerd-config --config {bed.config}", "restart containerd"):
        assert needle in text, (needle, text)


def _nothing_left(bed: Bed, namespace: str) -> None:
    assert pods_in(bed, namespace) == [], "a refused restore left a sandbox behind"
    plans = os.path.join(bed.store, "plans")
    assert not os.path.isdir(plans) or not os.listdir(plans), os.listdir(plans)
    assert not our_helpers(bed), our_helpers(bed)


def our_helpers(bed: Bed) -> list[str]:
    """The page sources (and any lazy-pages daemons) of this bed's agent."""
    return lazy_helpers(os.path.join(bed.store, "plans") + "/")


@pytest.fixture(scope="module")
def mischeckpoint(misbed: Bed) -> Any:
    pod = counter_pod(misbed, "e2e-mis", flip=False)
    try:
        wait_for(lambda: len(ticks(container_detail(misbed, pod.containers["shell"]).log_path)) >= 3,
                 what="source ticks")
        ckpt = misbed.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        yield pod, ckpt
    finally:
        remove_pod(misbed, pod.id)


@pytest.mark.parametrize("start", [False, True])
def test_a_handler_serving_another_store_fails_the_cli_restore_and_leaves_nothing(
        misbed: Bed, mischeckpoint: Any, start: bool) -> None:
    _pod, ckpt = mischeckpoint
    args = ["restore", ckpt, "--namespace", "e2e-mis-dst", "--name", "copy"] + (["--start"] if start else [])
    cp = misbed.cli(*args, check=False)
    assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr, cp.stdout + cp.stderr
    _handler_refusal(cp.stderr, misbed)
    assert "restore as pod e2e-mis-dst/copy" in cp.stderr
    _nothing_left(misbed, "e2e-mis-dst")


def test_a_handler_serving_another_store_fails_restore_pod(misbed: Bed, mischeckpoint: Any, tmp_path: Path) -> None:
    src, _ = mischeckpoint
    out = tmp_path / "ckpt"
    out.mkdir()
    checkpoint_pod(misbed, src.id, str(out), [src.containers["shell"]])
    pcfg = pod_config(misbed, "e2e-mis-cri", "copy")
    req = cri.RestorePodRequest(checkpoint_path=str(out), config=_parse(pcfg, cri.PodSandboxConfig, "pod"),
                                container_configs=[_parse(shell(misbed), cri.ContainerConfig, "container")])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        raw_call(misbed.cri_endpoint, RT + "RestorePod", req.SerializeToString())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    _handler_refusal(e.value.details() or "", misbed)
    _nothing_left(misbed, "e2e-mis-cri")


def test_a_handler_serving_another_store_fails_the_pod_annotation_restore(misbed: Bed, mischeckpoint: Any) -> None:
    _pod, ckpt = mischeckpoint
    with reconfigured(misbed, "restore:\n  pod-sources:\n    e2e-mis-kubelet: [e2e-mis]\n"), \
            pytest.raises(errors.FailedPrecondition) as e:
        pod_via_agent(misbed, "e2e-mis-kubelet", [], annotations={RESTORE_FROM: ckpt})
    assert "restore of pod e2e-mis-kubelet/" in str(e.value) and ckpt in str(e.value)
    _handler_refusal(str(e.value), misbed)
    _nothing_left(misbed, "e2e-mis-kubelet")


def test_doctor_fails_and_serve_warns_on_a_node_whose_handler_serves_another_store(misbed: Bed) -> None:
    cp = misbed.cli("doctor", "--config", misbed.config, check=False)
    assert cp.returncode != 0, cp.stdout
    line = next(x for x in cp.stdout.splitlines() if "restore handler" in x)
    assert line.startswith("FAIL") and f"{misbed.store}/plans" in line and "other-store/plans" in line, line
    with open(misbed.agent_log, encoding="utf-8", errors="replace") as fh:
        log = fh.read()
    assert "WARNING" in log and "restores will be refused" in log and "other-store/plans" in log, log[-3000:]


# ---- the mark: a restored container never starts from its image ----------------------------


@pytest.mark.also17
def test_a_marked_container_without_its_plan_is_refused_by_the_wrapper_with_the_agent_stopped(agent: Bed) -> None:
    src = counter_pod(agent, "e2e-mark", flip=False)
    new_pod = ""
    try:
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        out = agent.cli("restore", ckpt, "--namespace", "e2e-mark-dst", "--full").stdout.split()
        new_pod, cids = out[0], {out[i]: out[i + 1] for i in range(1, len(out), 2)}
        cid = cids["shell"]
        status = container_detail(agent, cid)
        assert status.container.state == "CONTAINER_CREATED"
        assert status.spec.get("annotations", {}).get(PLAN_ANNOTATION), "the handler must pass the mark through"
        agent.stop_agent()
        shutil.rmtree(os.path.join(agent.store, "plans", cid))  # the plan is gone

        err = start_refusal(agent, cid)
        assert err and PLAN_ANNOTATION in err and "no restore plan" in err, err
        st = container_detail(agent, cid)
        assert st.container.state != "CONTAINER_RUNNING"
        assert not ticks(st.log_path), "the image's command ran"
    finally:
        agent.start_agent()
        if new_pod:
            remove_pod(agent, new_pod)
        remove_pod(agent, src.id)


# ---- host access --------------------------------------------------------------------------


def rewrite(bed: Bed, checkpoint_id: str, edit: Callable[[dict[str, Any], dict[str, dict[str, Any]]], None]) -> str:
    """A genuine checkpoint with its saved configs edited, written back with every digest recomputed."""
    store = Store(bed.store)
    record = store.get(checkpoint_id)
    with tempfile.TemporaryDirectory(dir=bed.store) as tmp:
        store.materialize(record, tmp)
        pod_path = Path(tmp, "pod", "config.json")
        pod_doc = json.loads(pod_path.read_text())
        cfgs = {c["name"]: json.loads(Path(tmp, "containers", c["name"], "config.dump").read_text())
                for c in record.metadata["containers"]}
        edit(pod_doc["config"], {n: d["config"] for n, d in cfgs.items()})
        pod_path.write_text(json.dumps(pod_doc))
        for n, d in cfgs.items():
            Path(tmp, "containers", n, "config.dump").write_text(json.dumps(d))
        with store.writer() as w:
            w.add_tree("", tmp)
            new = w.commit(record.metadata, annotations=manifest_annotations(record.metadata))
    assert new.id != checkpoint_id and not store.verify(new.id)
    return new.id


def _ask_everything(host_dir: str) -> Callable[[dict[str, Any], dict[str, dict[str, Any]]], None]:
    """Every kind of host access: the pod's volume pointed at a host directory, a device, CDI devices
    (field and annotation), privileged mode, an added capability."""
    def edit(pod: dict[str, Any], containers: dict[str, dict[str, Any]]) -> None:
        pod.setdefault("linux", {}).setdefault("security_context", {})["privileged"] = True
        c = containers["shell"]
        [vol] = [m for m in c["mounts"] if m["container_path"] == "/data"]
        vol["host_path"] = host_dir
        c.setdefault("devices", []).append({"container_path": "/dev/xnull", "host_path": "/dev/null",
                                            "permissions": "rwm"})
        c["CDI_devices"] = [{"name": "vendor.example/gpu=0"}]
        c.setdefault("annotations", {})["cdi.k8s.io/e2e"] = "vendor.example/gpu=1"
        sc = c.setdefault("linux", {}).setdefault("security_context", {})
        sc["privileged"] = True
        sc.setdefault("capabilities", {})["add_capabilities"] = ["SYS_ADMIN"]
    return edit


def _host_namespaces(pod: dict[str, Any], containers: dict[str, dict[str, Any]]) -> None:
    pod.setdefault("linux", {}).setdefault("security_context", {}).setdefault("namespace_options", {})["network"] = 2
    containers["shell"].setdefault("linux", {}).setdefault("security_context", {}).setdefault(
        "namespace_options", {})["ipc"] = 2


@pytest.mark.also17
def test_a_checkpoint_asking_for_host_access_is_refused_by_name_and_restores_when_allowed(
        agent: Bed, tmp_path: Path) -> None:
    imgs = agent.info["images"]
    secret_dir = tmp_path / "hostside"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text("host only\n")
    uid = str(uuid.uuid4())
    src = make_pod(agent, "e2e-host", [container_config("shell", imgs["busybox"], [
        "sh", "-c", "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done",
    ], mounts=[{"container_path": "/data", "host_path": volume_dir(agent, uid, "data")}])], uid=uid)
    made: list[str] = []
    new_pod = ""
    cdi_spec = Path(agent.info["cdi_dir"], "e2e-host-access.json")
    try:
        wait_for(lambda: len(ticks(container_detail(agent, src.containers["shell"]).log_path)) >= 3, what="ticks")
        genuine = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        made.append(genuine)
        everything = rewrite(agent, genuine, _ask_everything(str(secret_dir)))
        made.append(everything)
        cp = agent.cli("restore", everything, "--namespace", "e2e-host-dst", "--start", check=False)
        assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr, cp.stderr
        for needle in (f"container shell mounts host path {secret_dir} at /data",
                       "container shell gets device /dev/null as /dev/xnull",
                       "container shell asks for CDI device vendor.example/gpu=0",
                       "container shell asks for CDI devices vendor.example/gpu=1 (annotation cdi.k8s.io/e2e)",
                       "the pod is privileged", "container shell is privileged",
                       "container shell adds capabilities CAP_SYS_ADMIN", "allow-host-access=true"):
            assert needle in cp.stderr, (needle, cp.stderr)
        assert pods_in(agent, "e2e-host-dst") == []
        hostns = rewrite(agent, genuine, _host_namespaces)
        made.append(hostns)
        cp = agent.cli("restore", hostns, "--namespace", "e2e-host-dst", check=False)
        assert cp.returncode != 0
        assert "the pod uses the host's network namespace" in cp.stderr, cp.stderr
        assert "container shell uses the host's ipc namespace" in cp.stderr, cp.stderr
        for bad in ("", "1", "yes"):
            cp = agent.cli("restore", everything, "--namespace", "e2e-host-dst", "--option",
                           f"allow-host-access={bad}", check=False)
            assert cp.returncode != 0 and "INVALID_ARGUMENT" in cp.stderr, cp.stderr
        assert pods_in(agent, "e2e-host-dst") == []

        # Allowed: the same checkpoint restores, and the restored process really sees the host directory
        # and gets the CDI devices, which the bed's own spec resolves to /dev/null.
        cdi_spec.write_text(json.dumps({
            "cdiVersion": "0.5.0", "kind": "vendor.example/gpu",
            "devices": [{"name": n, "containerEdits": {"deviceNodes": [
                {"path": f"/dev/e2e-gpu{n}", "hostPath": "/dev/null"}]}} for n in ("0", "1")],
        }))
        out = agent.cli("restore", everything, "--namespace", "e2e-host-dst", "--start",
                        "--option", "allow-host-access=true").stdout.split()
        new_pod, cid = out[0], out[2]
        d = container_detail(agent, cid)
        assert d.container.state == "CONTAINER_RUNNING"
        first = wait_for(lambda: ticks(d.log_path), what="restored ticks")[0]
        assert first > 3, f"the counter restarted: first tick {first}"
        assert Path(f"/proc/{d.pid}/root/data/secret.txt").read_text() == "host only\n"
        # The devices are in the container's OCI spec, so its device cgroup allows them (/dev itself is
        # the checkpoint's: CRIU restores that tmpfs as it was).
        spec = json.loads(Path(agent.info["state"], "containerd", "io.containerd.runtime.v2.task", "k8s.io",
                               cid, "config.json").read_text())
        paths = {dev["path"] for dev in spec["linux"].get("devices", [])}
        assert {"/dev/e2e-gpu0", "/dev/e2e-gpu1", "/dev/xnull"} <= paths, paths
        # No annotation of the checkpoint reached the container, only the restore's own mark.
        ann = d.container.annotations
        assert "cdi.k8s.io/e2e" not in ann and ann.get(PLAN_ANNOTATION), ann
    finally:
        if new_pod:
            remove_pod(agent, new_pod)
        remove_pod(agent, src.id)
        for ckpt in made:
            agent.cli("checkpoints", "rm", ckpt, check=False)
        subprocess.run(["rm", "-rf", os.path.join(agent.info["kubelet_root"], "pods", uid)], check=False)
        cdi_spec.unlink(missing_ok=True)


def test_a_pods_own_volume_needs_no_permission(agent: Bed) -> None:
    imgs = agent.info["images"]
    uid = str(uuid.uuid4())
    vol = volume_dir(agent, uid, "data")
    src = make_pod(agent, "e2e-ownvol", [container_config("shell", imgs["busybox"], [
        "sh", "-c", "exec 3>>/data/log; i=0; while :; do i=$((i+1)); echo tick $i; echo $i >&3; sleep 0.2; done",
    ], mounts=[{"container_path": "/data", "host_path": vol}])], uid=uid)
    new_pod = ""
    try:
        wait_for(lambda: len(ticks(os.path.join(vol, "log"))) >= 3, what="ticks")
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        out = agent.cli("restore", ckpt, "--namespace", "e2e-ownvol-dst", "--start").stdout.split()
        new_pod = out[0]
        d = container_detail(agent, out[2])
        assert wait_for(lambda: ticks(d.log_path), what="restored ticks")[0] > 3
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        if new_pod:
            remove_pod(agent, new_pod)
        remove_pod(agent, src.id)
        subprocess.run(["rm", "-rf", os.path.join(agent.info["kubelet_root"], "pods", uid)], check=False)


def test_the_pod_annotation_allowing_host_access_is_true_or_false_only(agent: Bed) -> None:
    from node_agent.api.cri_endpoint import ALLOW_HOST_ACCESS

    src = counter_pod(agent, "e2e-annot", flip=False)
    try:
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        for bad in ("", "1", "yes", "True"):
            with pytest.raises(errors.InvalidArgument) as e:
                pod_via_agent(agent, "e2e-annot-dst", [], annotations={RESTORE_FROM: ckpt, ALLOW_HOST_ACCESS: bad})
            assert ALLOW_HOST_ACCESS in str(e.value) and "expected true or false" in str(e.value)
        assert pods_in(agent, "e2e-annot-dst") == []
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, src.id)
