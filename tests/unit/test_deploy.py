"""deploy/: the manifests validate against Kubernetes 1.37 and agree with the agent's config and CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv

from node_agent.cli.main import build_parser
from node_agent.config.loading import load
from node_agent.config.schema import Settings
from node_agent.config.validation import host_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.37.0"
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _all() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in _docs(p)]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _all() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name)
    return found[0]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_1_37(path: Path) -> None:
    docs = _docs(path)
    assert docs
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)


def test_validator_really_rejects_a_bad_field() -> None:
    ds = _one("DaemonSet")
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["hostPId"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_ties_every_manifest_together() -> None:
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == sorted(p.name for p in MANIFESTS)
    assert k["namespace"] == "node-agent"
    images = {i["name"] for i in k["images"]}
    for c in _pod()["containers"] + _pod()["initContainers"]:
        assert c["image"].split(":")[0] in images


def _config_at(tmp: Path) -> Settings:
    text = _one("ConfigMap")["data"]["config.yaml"]
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.yaml").write_text(text)
    return load(str(tmp / "config.yaml"))  # the real loader: unknown keys are errors


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = _one("DaemonSet")["spec"]["template"]["spec"]
    return spec


def test_configmap_config_parses_with_the_agent_loader(tmp_path: Path) -> None:
    s = _config_at(tmp_path)
    assert s.health_listen and s.store == "/var/lib/node-agent"
    image_default = load(str(DEPLOY / "image" / "config.yaml"))
    assert image_default.health_listen


def test_clusterrole_grants_exactly_what_device_taints_and_podcheckpoints_need() -> None:
    role = _one("ClusterRole", "node-agent")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): sorted(r["verbs"]) for r in role["rules"]}
    assert rules == {
        (("resource.k8s.io",), ("resourceslices",)): ["get", "list", "watch"],
        (("resource.k8s.io",), ("devicetaintrules",)): sorted(["get", "list", "watch", "create", "update", "patch", "delete"]),
        (("node-agent.io",), ("podcheckpoints",)): sorted(["get", "list", "watch", "update", "delete"]),
        (("node-agent.io",), ("podcheckpoints/status",)): ["update"],
        (("",), ("pods", "nodes")): ["get"],
    }
    binding = _one("ClusterRoleBinding")
    sa = _one("ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    assert _pod()["serviceAccountName"] == sa["metadata"]["name"]


def test_restore_roles_grant_only_the_virtual_verbs_and_aggregate_into_nothing() -> None:
    # The admission policy (deploy/restore-admission.yaml, tests/unit/test_admission_policy.py) asks RBAC for these.
    for name, verb, resource in (("node-agent-restore", "restore", "checkpoints"),
                                 ("node-agent-restore-host-access", "restore-host-access", "checkpoints"),
                                 ("node-agent-restore-podcheckpoints", "restore", "podcheckpoints")):
        role = _one("ClusterRole", name)
        assert role["rules"] == [{"apiGroups": ["node-agent.io"], "resources": [resource], "verbs": [verb]}]
        assert "aggregationRule" not in role
        assert not any(k.startswith("rbac.authorization.k8s.io/aggregate-to") for k in role["metadata"]["labels"])
    # Bound by no one here: each cluster binds them where pod authors may restore.
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        assert all(d["roleRef"]["name"] == "node-agent" for d in _all() if d["kind"] == kind)
    policy = _one("ValidatingAdmissionPolicy")
    assert _one("ValidatingAdmissionPolicyBinding")["spec"]["policyName"] == policy["metadata"]["name"]


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    """mountPath -> host path, for hostPath volumes."""
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    out = {}
    for m in container["volumeMounts"]:
        v = volumes[m["name"]]
        if "hostPath" in v:
            out[m["mountPath"]] = v["hostPath"]["path"]
    return out


def _covered(path: str, mounts: dict[str, str]) -> bool:
    """`path` is visible in the container at the same host path."""
    for inside, host in mounts.items():
        if inside == host and (path == inside or path.startswith(inside.rstrip("/") + "/")):
            return True
    return False


def test_daemonset_is_privileged_with_the_host_mounts_the_agent_needs(tmp_path: Path) -> None:
    pod = _pod()
    assert pod["hostPID"] is True
    (agent,) = pod["containers"]
    assert agent["securityContext"]["privileged"] is True
    s = _config_at(tmp_path)
    mounts = _mounts(agent)
    socket_path = s.cri_endpoint.removeprefix("unix://")
    for path in (socket_path, s.runc_root, "/var/lib/containerd", s.store, os.path.dirname(s.socket), s.pod_log_root,
                 "/sys", "/sys/fs/cgroup", "/dev"):
        assert _covered(path, mounts), path
    assert mounts.get("/host/proc") == "/proc"
    # The registry hosts and the node's logins, as containerd and the kubelet have them, read-only.
    read_only = {m["mountPath"]: m.get("readOnly", False) for m in agent["volumeMounts"]}
    for path in (s.registry.config_path, s.registry.credentials_file):
        assert _covered(path, mounts), path
        inside = max((m for m in mounts if path.startswith(m.rstrip("/") + "/") or path == m), key=len)
        assert read_only[inside] is True, inside
    # doctor --deployment --host-root /host reads the host's containerd config and wrapper there, read-only.
    assert mounts.get("/host") == "/"
    assert {m["mountPath"]: m.get("readOnly", False) for m in agent["volumeMounts"]}["/host"] is True
    # Mounts made after the agent starts (sandbox shm, task rootfs) must reach it.
    props = {m["mountPath"]: m.get("mountPropagation") for m in agent["volumeMounts"]}
    assert props["/run/containerd"] == "HostToContainer"


def test_probes_use_the_health_listener(tmp_path: Path) -> None:
    s = _config_at(tmp_path)
    host, port = host_port(s.health_listen, default_host="127.0.0.1", what="health-listen")
    assert host == "0.0.0.0"  # the kubelet probes the pod's IP
    (agent,) = _pod()["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert agent[probe]["grpc"]["port"] == port, probe
    assert {"containerPort": port, "name": "health", "protocol": "TCP"} in agent["ports"]


def test_resources_and_gpu_tolerations() -> None:
    pod = _pod()
    for c in pod["containers"] + pod["initContainers"]:
        assert set(c["resources"]) == {"requests", "limits"}, c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(c["resources"]["limits"])
    keys = {t.get("key") for t in pod["tolerations"] if t["operator"] == "Exists"}
    assert {"nvidia.com/gpu", "amd.com/gpu"} <= keys


def test_init_container_installs_the_handler_with_the_agents_config(tmp_path: Path) -> None:
    pod = _pod()
    (init,) = pod["initContainers"]
    args = build_parser().parse_args(init["args"])
    assert args.command == "install-handler"
    assert args.root == "/host" and _mounts(init)["/host"] == "/"
    assert args.runtime_bundle == "/opt/node-agent/runtime" and args.criu_bundle == "/opt/node-agent/criu"
    # The agent leaves the wrapper to the init container, which runs it on the bundle's Python.
    assert _config_at(tmp_path).wrapper_python == args.runtime_bundle + "/bin/python3"
    assert args.config == "/etc/node-agent/config.yaml"
    (agent,) = pod["containers"]
    serve = build_parser().parse_args(agent["args"])
    assert serve.command == "serve" and serve.config == args.config
    # Both read the same ConfigMap.
    cfg_mounts = {c["name"]: {m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config"} for c in (init, agent)}
    assert cfg_mounts == {init["name"]: {"/etc/node-agent"}, agent["name"]: {"/etc/node-agent"}}
