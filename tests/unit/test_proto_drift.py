"""The generated protobuf code matches proto/, and the CRI schema matches the wire.

The CRI messages must decode what containerd sends: the field numbers of the
checkpoint calls are fixed by the CRI (KEP-5823), and the configs the agent
reads back from containerd's verbose JSON must have every field, or parts of
a pod would be lost on restore.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from node_agent._proto.k8s.cri.runtime.v1 import api_pb2, api_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]

T = FieldDescriptor  # type constants


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-proto"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- field numbers ------------------------------------------------------------


def _field(message: Any, name: str) -> FieldDescriptor:
    field = message.DESCRIPTOR.fields_by_name.get(name)
    assert field is not None, f"{message.DESCRIPTOR.full_name} has no field {name}"
    return cast(FieldDescriptor, field)


def _is_string_map(field: FieldDescriptor) -> bool:
    entry = field.message_type
    return (
        entry is not None
        and entry.GetOptions().map_entry
        and entry.fields_by_name["key"].type == T.TYPE_STRING
        and entry.fields_by_name["value"].type == T.TYPE_STRING
    )


def _assert_fields(message: Any, expected: dict[str, tuple[int, str]]) -> None:
    """expected: name -> (number, kind), kind in string/strings/map/<Message>/[<Message>]."""
    actual = {f.name for f in message.DESCRIPTOR.fields}
    assert actual == set(expected), message.DESCRIPTOR.full_name
    for name, (number, kind) in expected.items():
        field = _field(message, name)
        assert field.number == number, f"{message.DESCRIPTOR.full_name}.{name}"
        repeated = field.is_repeated
        if kind == "string":
            assert field.type == T.TYPE_STRING and not repeated
        elif kind == "strings":
            assert field.type == T.TYPE_STRING and repeated
        elif kind == "map":
            assert repeated and _is_string_map(field)
        elif kind.startswith("["):
            assert repeated and field.message_type is not None
            assert field.message_type.full_name == f"runtime.v1.{kind[1:-1]}"
        else:
            assert not repeated and field.message_type is not None
            assert field.message_type.full_name == f"runtime.v1.{kind}"


def test_checkpoint_pod_messages() -> None:
    _assert_fields(
        api_pb2.CheckpointPodRequest,
        {
            "pod_sandbox_id": (1, "string"),
            "output_path": (2, "string"),
            "container_ids": (3, "strings"),
            "options": (4, "map"),
        },
    )
    assert not api_pb2.CheckpointPodResponse.DESCRIPTOR.fields


def test_restore_pod_messages() -> None:
    _assert_fields(
        api_pb2.RestorePodRequest,
        {
            "checkpoint_path": (1, "string"),
            "config": (2, "PodSandboxConfig"),
            "runtime_handler": (3, "string"),
            "options": (4, "map"),
            "container_configs": (5, "[ContainerConfig]"),
        },
    )
    _assert_fields(
        api_pb2.RestorePodResponse,
        {"pod_sandbox_id": (1, "string"), "restored_containers": (2, "[RestoredContainer]")},
    )
    _assert_fields(
        api_pb2.RestoredContainer, {"name": (1, "string"), "container_id": (2, "string")}
    )


def test_status_messages() -> None:
    assert {f.name: (f.number, f.type) for f in api_pb2.StatusRequest.DESCRIPTOR.fields} == {"verbose": (1, T.TYPE_BOOL)}
    _assert_fields(
        api_pb2.StatusResponse,
        {"status": (1, "RuntimeStatus"), "info": (2, "map"), "runtime_handlers": (3, "[RuntimeHandler]"),
         "features": (4, "RuntimeFeatures")},
    )
    _assert_fields(api_pb2.RuntimeStatus, {"conditions": (1, "[RuntimeCondition]")})
    _assert_fields(api_pb2.RuntimeHandler, {"name": (1, "string"), "features": (2, "RuntimeHandlerFeatures")})


def test_checkpoint_container_message() -> None:
    descriptor = api_pb2.CheckpointContainerRequest.DESCRIPTOR
    fields = {f.name: (f.number, f.type) for f in descriptor.fields}
    assert fields == {
        "container_id": (1, T.TYPE_STRING),
        "location": (2, T.TYPE_STRING),
        "timeout": (3, T.TYPE_INT64),
    }


# Upstream numbers of fields that were added late or out of order, where a
# slip would go unnoticed until a runtime sends them.
UPSTREAM_NUMBERS = [
    ("ImageSpec", "user_specified_image", 18),
    ("ImageSpec", "runtime_handler", 19),
    ("ImageSpec", "image_ref", 20),
    ("Mount", "uidMappings", 6),
    ("Mount", "gidMappings", 7),
    ("Mount", "recursive_read_only", 8),
    ("Mount", "image", 9),
    ("Mount", "image_sub_path", 10),
    ("ContainerConfig", "linux", 15),
    ("ContainerConfig", "CDI_devices", 17),
    ("ContainerConfig", "stop_signal", 18),
    ("LinuxSandboxSecurityContext", "seccomp_profile_path", 7),
    ("LinuxSandboxSecurityContext", "run_as_group", 8),
    ("LinuxSandboxSecurityContext", "seccomp", 9),
    ("LinuxSandboxSecurityContext", "apparmor", 10),
    ("LinuxSandboxSecurityContext", "supplemental_groups_policy", 11),
    ("LinuxContainerSecurityContext", "apparmor_profile", 9),
    ("LinuxContainerSecurityContext", "seccomp_profile_path", 10),
    ("LinuxContainerSecurityContext", "no_new_privs", 11),
    ("LinuxContainerSecurityContext", "run_as_group", 12),
    ("LinuxContainerSecurityContext", "masked_paths", 13),
    ("LinuxContainerSecurityContext", "readonly_paths", 14),
    ("LinuxContainerSecurityContext", "seccomp", 15),
    ("LinuxContainerSecurityContext", "apparmor", 16),
    ("LinuxContainerSecurityContext", "supplemental_groups_policy", 17),
    ("LinuxContainerResources", "unified", 9),
    ("LinuxContainerResources", "memory_swap_limit_in_bytes", 10),
    ("LinuxPodSandboxConfig", "overhead", 4),
    ("LinuxPodSandboxConfig", "resources", 5),
    ("NamespaceOption", "userns_options", 5),
    ("Namespace", "options", 2),
    ("PodSandboxStatusResponse", "containers_statuses", 3),
    ("PodSandboxStatusResponse", "timestamp", 4),
    ("ContainerStatus", "image_id", 17),
    ("ContainerStatus", "user", 18),
    ("ContainerStatus", "stop_signal", 19),
    ("Container", "image_id", 10),
    ("Image", "pinned", 8),
]


@pytest.mark.parametrize(("message", "field", "number"), UPSTREAM_NUMBERS)
def test_upstream_field_numbers(message: str, field: str, number: int) -> None:
    assert _field(getattr(api_pb2, message), field).number == number


def test_windows_numbers_stay_unused() -> None:
    windows = [("PodSandboxConfig", 9), ("ContainerConfig", 16), ("ContainerResources", 2)]
    for message, number in windows:
        descriptor = getattr(api_pb2, message).DESCRIPTOR
        assert number not in descriptor.fields_by_number


# -- services -------------------------------------------------------------------

RUNTIME_METHODS = {
    "Version",
    "RunPodSandbox",
    "StopPodSandbox",
    "RemovePodSandbox",
    "PodSandboxStatus",
    "ListPodSandbox",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "ListContainers",
    "ContainerStatus",
    "Status",
    "CheckpointContainer",
    "CheckpointPod",
    "RestorePod",
}
IMAGE_METHODS = {"ListImages", "ImageStatus", "PullImage"}


class _RecordingChannel:
    """Stands in for a grpc channel and records the method paths a stub binds."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def unary_unary(self, path: str, *args: object, **kwargs: object) -> object:
        self.paths.append(path)
        return object()


def test_service_names_and_method_paths() -> None:
    services = api_pb2.DESCRIPTOR.services_by_name
    assert set(services) == {"RuntimeService", "ImageService"}
    assert services["RuntimeService"].full_name == "runtime.v1.RuntimeService"
    assert services["ImageService"].full_name == "runtime.v1.ImageService"
    assert {m.name for m in services["RuntimeService"].methods} == RUNTIME_METHODS
    assert {m.name for m in services["ImageService"].methods} == IMAGE_METHODS

    runtime = _RecordingChannel()
    cast(Any, api_pb2_grpc).RuntimeServiceStub(runtime)
    assert set(runtime.paths) == {f"/runtime.v1.RuntimeService/{m}" for m in RUNTIME_METHODS}
    assert "/runtime.v1.RuntimeService/CheckpointPod" in runtime.paths
    assert "/runtime.v1.RuntimeService/RestorePod" in runtime.paths

    images = _RecordingChannel()
    cast(Any, api_pb2_grpc).ImageServiceStub(images)
    assert set(images.paths) == {f"/runtime.v1.ImageService/{m}" for m in IMAGE_METHODS}

    checkpoint_pod = services["RuntimeService"].methods_by_name["CheckpointPod"]
    assert checkpoint_pod.input_type.full_name == "runtime.v1.CheckpointPodRequest"
    assert checkpoint_pod.output_type.full_name == "runtime.v1.CheckpointPodResponse"
    restore_pod = services["RuntimeService"].methods_by_name["RestorePod"]
    assert restore_pod.input_type.full_name == "runtime.v1.RestorePodRequest"
    assert restore_pod.output_type.full_name == "runtime.v1.RestorePodResponse"


# -- containerd's verbose JSON ------------------------------------------------------
#
# containerd reports the configs it was given under info["config"] of verbose
# ContainerStatus / PodSandboxStatus, marshalled with Go's encoding/json: field
# names are the proto names (json tags, `omitempty`), enums are integers,
# int64 values are JSON numbers and zero values are left out.

POD_UID = "5f0c2a1e-8d4b-4c1a-9e2f-7b3d6a8c9e10"
POD_DIR = f"/var/lib/kubelet/pods/{POD_UID}"

# The example the agent's restore path is built around.
MINIMAL_CONTAINER_CONFIG = {
    "metadata": {"name": "app"},
    "image": {"image": "localhost/x:1"},
    "command": ["sh"],
    "envs": [{"key": "A", "value": "b"}],
    "mounts": [{"container_path": "/data", "host_path": "/tmp/d", "propagation": 0}],
    "log_path": "app/0.log",
    "linux": {
        "resources": {"cpu_shares": 2, "oom_score_adj": 0},
        "security_context": {"namespace_options": {"network": 0, "pid": 1}},
    },
}

# A kubelet-created container as containerd 1.6 reports it.
CONTAINERD_16_CONTAINER_CONFIG = {
    "metadata": {"name": "app", "attempt": 1},
    "image": {"image": "sha256:9c7a5a8a2f3e1d0b6c4e8f7a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e"},
    "command": ["/bin/sh", "-c"],
    "args": ["while true; do date >> /data/log; sleep 1; done"],
    "working_dir": "/srv",
    "envs": [
        {"key": "MODE", "value": "demo"},
        {"key": "KUBERNETES_SERVICE_HOST", "value": "10.96.0.1"},
        {"key": "KUBERNETES_SERVICE_PORT", "value": "443"},
    ],
    "mounts": [
        {"container_path": "/data", "host_path": f"{POD_DIR}/volumes/kubernetes.io~empty-dir/data"},
        {
            "container_path": "/var/run/secrets/kubernetes.io/serviceaccount",
            "host_path": f"{POD_DIR}/volumes/kubernetes.io~projected/kube-api-access-7xk2p",
            "readonly": True,
        },
        {
            "container_path": "/mnt/host",
            "host_path": "/mnt/shared",
            "propagation": 1,
            "selinux_relabel": True,
        },
        {"container_path": "/etc/hosts", "host_path": f"{POD_DIR}/etc-hosts"},
        {
            "container_path": "/dev/termination-log",
            "host_path": f"{POD_DIR}/containers/app/0f1e2d3c",
        },
    ],
    "devices": [{"container_path": "/dev/fuse", "host_path": "/dev/fuse", "permissions": "mrw"}],
    "labels": {
        "io.kubernetes.container.name": "app",
        "io.kubernetes.pod.name": "web-5d8f7c9b6-x2k4p",
        "io.kubernetes.pod.namespace": "default",
        "io.kubernetes.pod.uid": POD_UID,
    },
    "annotations": {
        "io.kubernetes.container.hash": "6d2f4a1b",
        "io.kubernetes.container.restartCount": "1",
        "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
        "io.kubernetes.container.terminationMessagePolicy": "File",
        "io.kubernetes.pod.terminationGracePeriod": "30",
    },
    "log_path": "app/1.log",
    "stdin": True,
    "tty": True,
    "linux": {
        "resources": {
            "cpu_period": 100000,
            "cpu_quota": 50000,
            "cpu_shares": 512,
            "memory_limit_in_bytes": 268435456,
            "oom_score_adj": 968,
            "hugepage_limits": [{"page_size": "2MB"}, {"page_size": "1GB"}],
            "unified": {"memory.oom.group": "1"},
        },
        "security_context": {
            "capabilities": {"add_capabilities": ["NET_ADMIN"], "drop_capabilities": ["ALL"]},
            "namespace_options": {"pid": 1},
            "selinux_options": {"type": "spc_t", "level": "s0:c123,c456"},
            "run_as_user": {"value": 1000},
            "readonly_rootfs": True,
            "supplemental_groups": [2000],
            "no_new_privs": True,
            "masked_paths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/sys/firmware"],
            "readonly_paths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"],
            "seccomp": {},
            "apparmor": {"profile_type": 2, "localhost_ref": "k8s-apparmor-example"},
            "seccomp_profile_path": "runtime/default",
            "apparmor_profile": "localhost/k8s-apparmor-example",
        },
    },
}

# Fields newer CRI versions added, as containerd 1.7 / 2.x report them.
RECENT_CONTAINER_CONFIG = {
    "metadata": {"name": "trainer"},
    "image": {
        "image": "sha256:1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f809",
        "user_specified_image": "registry.example/ml/trainer:2.1",
        "annotations": {"io.kubernetes.cri.image-platform": "linux/amd64"},
    },
    "mounts": [
        {
            "container_path": "/models",
            "image": {"image": "registry.example/ml/weights@sha256:0f" + "0" * 62},
            "image_sub_path": "v3",
            "readonly": True,
        },
        {
            "container_path": "/cache",
            "host_path": "/var/cache/ml",
            "readonly": True,
            "recursive_read_only": True,
            "uidMappings": [{"container_id": 0, "host_id": 65536, "length": 65536}],
            "gidMappings": [{"host_id": 65536, "length": 65536}],
        },
    ],
    "log_path": "trainer/0.log",
    "linux": {
        "resources": {
            "memory_swap_limit_in_bytes": 536870912,
            "cpuset_cpus": "0-3",
            "cpuset_mems": "0",
        },
        "security_context": {
            "namespace_options": {
                "pid": 1,
                "userns_options": {
                    "mode": 0,
                    "uids": [{"host_id": 65536, "length": 65536}],
                    "gids": [{"host_id": 65536, "length": 65536}],
                },
            },
            "run_as_user": {},
            "run_as_group": {"value": 3000},
            "supplemental_groups_policy": 1,
            "seccomp": {"profile_type": 1},
        },
    },
    "CDI_devices": [{"name": "nvidia.com/gpu=0"}, {"name": "nvidia.com/gpu=1"}],
    "stop_signal": 18,
}

# A kubelet-created sandbox as containerd reports it.
POD_SANDBOX_CONFIG = {
    "metadata": {
        "name": "web-5d8f7c9b6-x2k4p",
        "uid": POD_UID,
        "namespace": "default",
        "attempt": 1,
    },
    "hostname": "web-5d8f7c9b6-x2k4p",
    "log_directory": f"/var/log/pods/default_web-5d8f7c9b6-x2k4p_{POD_UID}",
    "dns_config": {
        "servers": ["10.96.0.10"],
        "searches": ["default.svc.cluster.local", "svc.cluster.local", "cluster.local"],
        "options": ["ndots:5"],
    },
    "port_mappings": [
        {"container_port": 8080},
        {"protocol": 1, "container_port": 53, "host_port": 5353, "host_ip": "127.0.0.1"},
        {"protocol": 2, "container_port": 9899},
    ],
    "labels": {
        "app": "web",
        "pod-template-hash": "5d8f7c9b6",
        "io.kubernetes.pod.name": "web-5d8f7c9b6-x2k4p",
        "io.kubernetes.pod.namespace": "default",
        "io.kubernetes.pod.uid": POD_UID,
    },
    "annotations": {
        "kubernetes.io/config.seen": "2024-05-02T09:14:03.512734829Z",
        "kubernetes.io/config.source": "api",
    },
    "linux": {
        "cgroup_parent": f"/kubepods/burstable/pod{POD_UID}",
        "security_context": {
            "namespace_options": {"network": 0, "pid": 1},
            "selinux_options": {"level": "s0:c123,c456"},
            "run_as_user": {"value": 1000},
            "run_as_group": {"value": 3000},
            "supplemental_groups": [2000],
            "seccomp": {},
            "seccomp_profile_path": "runtime/default",
        },
        "sysctls": {"net.ipv4.ip_unprivileged_port_start": "0", "kernel.shm_rmid_forced": "1"},
        "overhead": {},
        "resources": {
            "cpu_period": 100000,
            "cpu_quota": 150000,
            "cpu_shares": 1536,
            "memory_limit_in_bytes": 805306368,
        },
    },
}


@pytest.mark.parametrize(
    "sample",
    [MINIMAL_CONTAINER_CONFIG, CONTAINERD_16_CONTAINER_CONFIG, RECENT_CONTAINER_CONFIG],
    ids=["minimal", "containerd-1.6", "recent"],
)
def test_container_config_json_has_no_unknown_fields(sample: dict[str, Any]) -> None:
    config = json_format.ParseDict(sample, api_pb2.ContainerConfig(), ignore_unknown_fields=False)
    assert config.metadata.name == sample["metadata"]["name"]
    assert config.log_path == sample["log_path"]
    # Nothing is lost: back to JSON with proto names, every key is still there.
    again = json_format.MessageToDict(config, preserving_proto_field_name=True)
    assert _keys(again) >= _keys(sample, drop_zero=True)


def test_container_config_values() -> None:
    config = json_format.ParseDict(CONTAINERD_16_CONTAINER_CONFIG, api_pb2.ContainerConfig())
    sc = config.linux.security_context
    assert sc.namespace_options.pid == api_pb2.CONTAINER
    assert sc.run_as_user.value == 1000
    assert sc.HasField("seccomp")
    assert sc.seccomp.profile_type == api_pb2.SecurityProfile.RuntimeDefault
    assert config.mounts[2].propagation == api_pb2.PROPAGATION_HOST_TO_CONTAINER
    assert config.linux.resources.memory_limit_in_bytes == 268435456
    assert [h.page_size for h in config.linux.resources.hugepage_limits] == ["2MB", "1GB"]

    recent = json_format.ParseDict(RECENT_CONTAINER_CONFIG, api_pb2.ContainerConfig())
    assert [d.name for d in recent.CDI_devices] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert recent.stop_signal == api_pb2.SIGQUIT
    assert recent.mounts[1].uidMappings[0].host_id == 65536
    assert recent.linux.security_context.supplemental_groups_policy == api_pb2.Strict
    assert recent.linux.security_context.HasField("run_as_user")  # {} is uid 0, not unset


def test_pod_sandbox_config_json_has_no_unknown_fields() -> None:
    config = json_format.ParseDict(
        POD_SANDBOX_CONFIG, api_pb2.PodSandboxConfig(), ignore_unknown_fields=False
    )
    assert config.metadata.uid == POD_UID
    assert config.linux.cgroup_parent == f"/kubepods/burstable/pod{POD_UID}"
    assert config.linux.security_context.namespace_options.pid == api_pb2.CONTAINER
    assert config.linux.sysctls["kernel.shm_rmid_forced"] == "1"
    assert [p.protocol for p in config.port_mappings] == [api_pb2.TCP, api_pb2.UDP, api_pb2.SCTP]
    assert config.dns_config.options == ["ndots:5"]
    again = json_format.MessageToDict(config, preserving_proto_field_name=True)
    assert _keys(again) >= _keys(POD_SANDBOX_CONFIG, drop_zero=True)


@pytest.mark.parametrize(
    ("message", "sample"),
    [
        (api_pb2.ContainerConfig, {"metadata": {"name": "a"}, "windows": {}}),
        (api_pb2.ContainerConfig, {"linux": {"security_context": {"run_as_uid": 0}}}),
        (api_pb2.PodSandboxConfig, {"linux": {"cgroupParent": "x", "sysctl": {}}}),
    ],
)
def test_unknown_fields_are_rejected(message: Any, sample: dict[str, Any]) -> None:
    with pytest.raises(json_format.ParseError):
        json_format.ParseDict(sample, message(), ignore_unknown_fields=False)


def _keys(value: Any, prefix: str = "", *, drop_zero: bool = False) -> set[str]:
    """Dotted paths of all keys with a non-zero value (map keys excluded)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if drop_zero and item in (0, False, "", [], None):
                continue
            path = f"{prefix}.{key}" if prefix else key
            out.add(path)
            if key not in ("labels", "annotations", "sysctls", "unified"):
                out |= _keys(item, path, drop_zero=drop_zero)
    elif isinstance(value, list):
        for item in value:
            out |= _keys(item, prefix + "[]", drop_zero=drop_zero)
    return out
