"""What a checkpoint's saved configs may reach on the host (node_agent.hostaccess)."""

from __future__ import annotations

from typing import Any

import pytest

from node_agent import errors, hostaccess
from node_agent.podformat import SavedPod
from node_agent.admission import parse_restore_options
from node_agent.restoring import target_container_config, target_pod_config

UID = "0f3e6a3c-7d7e-4b8a-9a55-1b7a3b1f2c11"
KUBELET = "/var/lib/kubelet"


def _pod(**linux: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": UID}, "linux": linux}


def _found(pod: dict[str, Any], **cfg: Any) -> list[str]:
    return hostaccess.findings(pod, [("app", cfg)], kubelet_root=KUBELET)


def test_a_plain_pod_with_its_own_volumes_reaches_nothing() -> None:
    own = f"{KUBELET}/pods/{UID}/volumes/kubernetes.io~empty-dir/data"
    assert _found(_pod(), mounts=[{"container_path": "/data", "host_path": own},
                                  {"container_path": "/etc/hosts", "host_path": f"{KUBELET}/pods/{UID}/etc-hosts"}],
                  linux={"security_context": {"capabilities": {"add_capabilities": ["NET_BIND_SERVICE", "CAP_KILL"]}}},
                  annotations={"io.kubernetes.container.hash": "1"}) == []


@pytest.mark.parametrize("cfg, needle", [
    ({"mounts": [{"container_path": "/host", "host_path": "/"}]}, "mounts host path / at /host"),
    ({"mounts": [{"container_path": "/x", "host_path": f"{KUBELET}/pods/{UID}/../other/volumes"}]}, "mounts host path"),
    ({"mounts": [{"container_path": "/x", "host_path": f"{KUBELET}/pods/other-uid/volumes/a"}]}, "mounts host path"),
    ({"mounts": [{"container_path": "/x", "host_path": f"{KUBELET}/pods/{UID}/volumes/a", "propagation": 2}]},
     "bidirectional propagation"),
    ({"mounts": [{"container_path": "/x", "host_path": ""}]}, "(empty)"),
    ({"devices": [{"container_path": "/dev/sda", "host_path": "/dev/sda", "permissions": "rwm"}]}, "device /dev/sda"),
    ({"CDI_devices": [{"name": "nvidia.com/gpu=0"}]}, "CDI device nvidia.com/gpu=0"),
    ({"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}}, "CDI devices nvidia.com/gpu=all"),
    ({"linux": {"security_context": {"privileged": True}}}, "container app is privileged"),
    ({"linux": {"security_context": {"namespace_options": {"pid": 2}}}}, "host's pid namespace"),
    ({"linux": {"security_context": {"capabilities": {"add_capabilities": ["SYS_ADMIN"]}}}}, "CAP_SYS_ADMIN"),
    ({"linux": {"security_context": {"capabilities": {"add_capabilities": ["ALL"]}}}}, "capabilities ALL"),
])
def test_each_kind_of_host_access_is_named(cfg: dict[str, Any], needle: str) -> None:
    found = _found(_pod(), **cfg)
    assert len(found) == 1 and needle in found[0], found


def test_pod_level_host_access_is_named() -> None:
    pod = _pod(security_context={"privileged": True, "namespace_options": {"network": 2, "ipc": 2}})
    pod["port_mappings"] = [{"container_port": 80, "host_port": 8080}]
    found = _found(pod)
    assert "the pod is privileged" in found and "the pod uses the host's network namespace" in found
    assert "the pod uses the host's ipc namespace" in found and "the pod maps host port 8080" in found


def test_an_unusable_pod_uid_owns_no_volumes() -> None:
    pod = _pod()
    pod["metadata"]["uid"] = ".."
    assert _found(pod, mounts=[{"container_path": "/x", "host_path": f"{KUBELET}/pods/../etc"}])


def test_refusal_names_every_item_unless_allowed() -> None:
    found = ["container a is privileged", "container a gets device /dev/sda as /dev/sda"]
    with pytest.raises(errors.FailedPrecondition) as e:
        hostaccess.refuse("checkpoint sha256:x", found, allowed=False)
    assert all(f in str(e.value) for f in found) and "allow-host-access=true" in str(e.value)
    hostaccess.refuse("checkpoint sha256:x", found, allowed=True)
    hostaccess.refuse("checkpoint sha256:x", [], allowed=False)


@pytest.mark.parametrize("value", ["", "1", "yes", "True ", "on"])
def test_allow_host_access_takes_true_or_false_only(value: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        parse_restore_options({"allow-host-access": value})
    assert parse_restore_options({"allow-host-access": "true"}).allow_host_access is True
    assert parse_restore_options({"allow-host-access": "false", "lazy": "false"}).lazy is False


def test_checkpoint_annotations_never_reach_the_new_pod_or_container() -> None:
    saved = SavedPod("ns", "p", {**_pod(), "log_directory": "/etc/cron.d/ns_p_x",
                               "annotations": {"io.kubernetes.cri.untrusted-workload": "true"}}, (), ())
    pod = target_pod_config(saved, "staging", "copy", "u1", "sha256:x", "/var/log/pods")
    assert pod["annotations"] == {"node-agent.io/restored-from": "sha256:x"}
    assert pod["log_directory"] == "/var/log/pods/staging_copy_u1"
    cfg = {"metadata": {"name": "app"}, "annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=0,nvidia.com/gpu=1",
                                                        "io.kubernetes.container.hash": "1"}}
    assert target_container_config(cfg, "app", allow_host_access=False)["annotations"] == {}
    allowed = target_container_config(cfg, "app", allow_host_access=True)
    assert allowed["annotations"] == {}
    assert allowed["CDI_devices"] == [{"name": "nvidia.com/gpu=0"}, {"name": "nvidia.com/gpu=1"}]
