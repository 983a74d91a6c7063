"""Between the agent's dataclasses and its API messages."""

from __future__ import annotations

from typing import Any, Mapping

from node_agent import podformat, registry, transfers
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent.progress import Progress
from node_agent.replicas import ReplicaState
from node_agent.restoring import RestoredPod
from node_agent.store import CheckpointRecord


def _s(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _f(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def checkpoint_info(rec: CheckpointRecord) -> pb.CheckpointInfo:
    meta: Mapping[str, Any] = rec.metadata if isinstance(rec.metadata, Mapping) else {}
    raw_pod = meta.get("pod")
    pod: Mapping[str, Any] = raw_pod if isinstance(raw_pod, Mapping) else {}
    sizes: dict[str, int] = {}
    for f in rec.files:
        parts = f.path.split("/")
        if len(parts) > 2 and parts[0] == podformat.CONTAINERS_DIR:
            sizes[parts[1]] = sizes.get(parts[1], 0) + f.size
    containers = []
    for c in meta.get("containers") or []:
        if not isinstance(c, Mapping):
            continue
        name = _s(c.get("name"))
        containers.append(pb.ContainerInfo(
            name=name, id=_s(c.get("id")), image=_s(c.get("image")), image_ref=_s(c.get("image_ref")),
            size=sizes.get(name, 0), dump_log=podformat.container_path(name, podformat.DUMP_LOG), dump_ms=_f(c.get("dump_ms")),
        ))
    raw_opts = meta.get("options")
    opts: Mapping[str, Any] = raw_opts if isinstance(raw_opts, Mapping) else {}
    # A locked checkpoint (its key is not here) says only its clear annotations.
    clear_ns, _, clear_name = (rec.annotations.get(podformat.POD_ANNOTATION, "") if rec.locked else "").partition("/")
    return pb.CheckpointInfo(
        id=rec.id,
        pod_namespace=_s(pod.get("namespace")) or clear_ns,
        pod_name=_s(pod.get("name")) or clear_name,
        pod_uid=_s(pod.get("uid")),
        pod_sandbox_id=_s(pod.get("id")),
        containers=containers,
        created=_s(meta.get("created")) or rec.created,
        size=max(rec.size, 0),
        stored_size=rec.stored_size,
        frozen_ms=_f(meta.get("frozen_ms")),
        options={str(k): str(v) for k, v in opts.items()},
        criu_version=_s(meta.get("criu_version")),
        node=_s(meta.get("node")),
        pre_dump=meta.get("pre_dump") is True,
        annotations={str(k): str(v) for k, v in (getattr(rec, "annotations", None) or {}).items()},
        key_id=rec.key_id,
        locked=rec.locked,
    )


def progress(p: Progress) -> pb.Progress:
    return pb.Progress(
        phase=p.phase, containers_done=p.containers_done, containers_total=p.containers_total,
        bytes_done=p.bytes_done, bytes_total=p.bytes_total, message=p.message,
    )


def restore_result(r: RestoredPod) -> pb.RestoreResult:
    return pb.RestoreResult(
        pod_sandbox_id=r.pod_sandbox_id,
        containers=[pb.RestoredContainer(name=n, container_id=c) for n, c in r.containers],
        namespace=r.namespace, name=r.name, uid=r.uid, checkpoint_id=r.checkpoint_id, started=r.started,
    )


def restored_replica(s: ReplicaState) -> pb.RestoredReplica:
    r = s.replica
    return pb.RestoredReplica(
        pod_namespace=r.namespace, pod_name=r.pod_name, pod_sandbox_id=r.sandbox, container=r.container,
        container_id=r.container_id, checkpoint_id=r.checkpoint, lazy=r.lazy, state=s.state, reason=s.reason,
        pages_in=s.pages, pages_total=s.total, restored=r.restored, container_state=s.runtime,
    )


def registry_credentials(c: pb.RegistryCredentials) -> registry.Credentials:
    return registry.Credentials(
        username=c.username, password=c.password, ca_file=c.ca_file, ca_pem=c.ca_pem,
        plain_http=c.plain_http, insecure_skip_verify=c.insecure_skip_verify,
    )


def transfer_result(r: transfers.TransferResult) -> pb.TransferResult:
    return pb.TransferResult(
        checkpoint_id=r.checkpoint_id, reference=r.reference, blobs_transferred=r.blobs_transferred,
        blobs_skipped=r.blobs_skipped, bytes_transferred=r.bytes_transferred,
    )


def export_request(r: pb.ExportRequest) -> transfers.ExportRequest:
    return transfers.ExportRequest(
        checkpoint_id=r.checkpoint_id, container=r.container, output_path=r.output_path,
        compression=r.compression, plaintext=r.plaintext,
    )


def import_request(r: pb.ImportRequest) -> transfers.ImportRequest:
    return transfers.ImportRequest(input_path=r.input_path, namespace=r.namespace, name=r.name)
