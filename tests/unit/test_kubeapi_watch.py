"""The REST client's lists and watches, against the fake API server of tests/kube_fake.py; and that fake
itself keeping objects as the API server does (status subresource, conflicts, finalizers, schema, CEL)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from node_agent import errors
from node_agent.kubeapi import Gone, KubeClient, from_kubeconfig
from tests.kube_fake import FakeKube

GROUP = "/apis/node-agent.io/v1alpha1"


def pcp(name: str, pod: str = "web", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "node-agent.io/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": name, "namespace": "team"}, "spec": {"source": {"podName": pod}, **spec}}


@pytest.fixture
def api(tmp_path: Path) -> Any:
    with FakeKube(token="t0ken") as fake:
        yield fake


def client(api: FakeKube, tmp_path: Path) -> KubeClient:
    return KubeClient(from_kubeconfig(str(api.kubeconfig(tmp_path / "kubeconfig"))))


def test_a_list_says_its_version_and_a_watch_from_it_sees_what_came_after(api: FakeKube, tmp_path: Path) -> None:
    api.put("podcheckpoints", pcp("a"))
    k = client(api, tmp_path)
    items, version = k.list_all(f"{GROUP}/podcheckpoints")
    assert [i["metadata"]["name"] for i in items] == ["a"] and version
    api.put("podcheckpoints", pcp("b"))
    api.delete("podcheckpoints", "team", "a")
    seen = list(k.watch(f"{GROUP}/podcheckpoints", version, seconds=1))
    assert [(t, o["metadata"].get("name")) for t, o in seen] == [("ADDED", "b"), ("DELETED", "a"), ("BOOKMARK", None)]
    assert int(seen[-1][1]["metadata"]["resourceVersion"]) >= int(seen[1][1]["metadata"]["resourceVersion"])


def test_a_watch_from_a_compacted_version_is_gone(api: FakeKube, tmp_path: Path) -> None:
    k = client(api, tmp_path)
    _, version = k.list_all(f"{GROUP}/podcheckpoints")
    api.put("podcheckpoints", pcp("a"))
    api.compact()
    with pytest.raises(Gone, match="too old resource version"):
        list(k.watch(f"{GROUP}/podcheckpoints", version, seconds=1))


def test_a_watch_cut_mid_stream_ends_and_a_new_one_from_the_last_version_misses_nothing(
        api: FakeKube, tmp_path: Path) -> None:
    k = client(api, tmp_path)
    _, version = k.list_all(f"{GROUP}/podcheckpoints")
    api.put("podcheckpoints", pcp("a"))
    events = k.watch(f"{GROUP}/podcheckpoints", version, seconds=30)
    kind, obj = next(events)
    assert kind == "ADDED"
    threading.Timer(0.2, api.break_watches).start()
    assert list(events) == []  # cut: no BOOKMARK, no end of the stream
    api.put("podcheckpoints", pcp("b"))
    again = list(k.watch(f"{GROUP}/podcheckpoints", obj["metadata"]["resourceVersion"], seconds=1))
    assert [(t, o["metadata"].get("name")) for t, o in again] == [("ADDED", "b"), ("BOOKMARK", None)]


def test_status_goes_through_its_subresource_and_versions_conflict(api: FakeKube, tmp_path: Path) -> None:
    k = client(api, tmp_path)
    made = k.request("POST", f"{GROUP}/namespaces/team/podcheckpoints", pcp("a") | {"status": {"phase": "Failed"}})
    assert "status" not in made  # set only through /status
    path = f"{GROUP}/namespaces/team/podcheckpoints/a"
    made["status"] = {"phase": "Checkpointing", "node": "n1"}
    with_status = k.request("PUT", path + "/status", made)
    assert with_status["status"] == {"phase": "Checkpointing", "node": "n1"}
    with pytest.raises(errors.Aborted, match="has been modified"):
        k.request("PUT", path + "/status", made)  # made's version is the old one
    # A write to the object leaves the status alone; metadata.finalizers is the object's.
    with_status["status"] = {"phase": "Succeeded"}
    with_status["metadata"]["finalizers"] = ["node-agent.io/checkpoint"]
    kept = k.request("PUT", path, with_status)
    assert kept["status"] == {"phase": "Checkpointing", "node": "n1"} and kept["metadata"]["finalizers"]
    assert kept["metadata"]["generation"] == 1  # the spec did not change


def test_every_object_is_checked_against_the_crd_and_its_rules(api: FakeKube, tmp_path: Path) -> None:
    k = client(api, tmp_path)
    bad = pcp("a")
    bad["spec"]["source"]["podname"] = "typo"
    with pytest.raises(errors.InvalidArgument, match="Additional properties are not allowed"):
        k.request("POST", f"{GROUP}/namespaces/team/podcheckpoints", bad)
    made = k.request("POST", f"{GROUP}/namespaces/team/podcheckpoints", pcp("a"))
    made["spec"]["source"]["podName"] = "other"
    with pytest.raises(errors.InvalidArgument, match="spec is immutable"):
        k.request("PUT", f"{GROUP}/namespaces/team/podcheckpoints/a", made)
    made = k.request("GET", f"{GROUP}/namespaces/team/podcheckpoints/a")
    made["status"] = {"phase": "Done"}
    with pytest.raises(errors.InvalidArgument, match="is not one of"):
        k.request("PUT", f"{GROUP}/namespaces/team/podcheckpoints/a/status", made)
    patched = k.request("PATCH", f"{GROUP}/namespaces/team/podcheckpoints/a/status",
                        {"status": {"phase": "Failed", "message": "pod team/web is gone"}},
                        content_type="application/merge-patch+json")
    assert patched["status"]["phase"] == "Failed"
    assert len(api.state.problems) == 3


def test_deleting_waits_for_the_finalizers(api: FakeKube, tmp_path: Path) -> None:
    k = client(api, tmp_path)
    obj = pcp("a")
    obj["metadata"]["finalizers"] = ["node-agent.io/checkpoint"]
    k.request("POST", f"{GROUP}/namespaces/team/podcheckpoints", obj)
    path = f"{GROUP}/namespaces/team/podcheckpoints/a"
    k.request("DELETE", path)
    held = k.request("GET", path)
    assert held["metadata"]["deletionTimestamp"]
    held["metadata"]["finalizers"] = []
    k.request("PUT", path, held)
    with pytest.raises(errors.NotFound):
        k.request("GET", path)
    assert api.get("podcheckpoints", "team", "a") is None
