"""The Kubernetes REST client: kubeconfig and in-cluster credentials, TLS, errors, against 127.0.0.1."""

from __future__ import annotations

import base64
import json
import socket
import sys
from pathlib import Path

import pytest

from devices_fakes import FakeApiServer, resource_slice
from node_agent import errors
from node_agent.kubeapi import KubeClient, from_kubeconfig, in_cluster

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.pki import Pki  # noqa: E402

NODE = "n1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def b64(path: str) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def test_kubeconfig_with_embedded_ca_and_client_certificate(tmp_path: Path, pki: Pki) -> None:
    server = pki.server("apiserver")
    client = pki.client("kubelet", "system:node:n1")
    with FakeApiServer(NODE, tls=(server.cert, server.key, pki.ca)) as api:
        api.state.slices = [resource_slice("s", NODE, "d.example.com", NODE, [("dev", {})])]
        kc = tmp_path / "kubeconfig"
        kc.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "other",
            "clusters": [{"name": "c", "cluster": {"server": api.url, "certificate-authority-data": b64(pki.ca)}}],
            "users": [{"name": "u", "user": {"client-certificate-data": b64(client.cert),
                                             "client-key-data": b64(client.key)}}],
            "contexts": [{"name": "other", "context": {"cluster": "c", "user": "u"}}],
        }))
        k = KubeClient(from_kubeconfig(str(kc)))
        items = k.list_resource_slices(NODE)
        assert [i["metadata"]["name"] for i in items] == ["s"]
        assert api.state.client_certs == ["system:node:n1"]
        assert api.state.requests[0].query["fieldSelector"] == [f"spec.nodeName={NODE}"]
        # The wrong CA: refused at the handshake, as Unavailable.
        other = Pki(tmp_path / "other", name="other CA")
        kc2 = tmp_path / "kc2"
        kc2.write_text(kc.read_text().replace(b64(pki.ca), b64(other.ca)))
        with pytest.raises(errors.Unavailable, match="TLS"):
            KubeClient(from_kubeconfig(str(kc2))).list_resource_slices(NODE)
        assert api.state.problems == []


def test_in_cluster_token_is_read_again_for_every_request(tmp_path: Path, pki: Pki) -> None:
    server = pki.server("apiserver2")
    with FakeApiServer(NODE, tls=(server.cert, server.key, pki.ca)) as api:
        sa = tmp_path / "sa"
        sa.mkdir()
        (sa / "token").write_text("test-token\n")
        (sa / "ca.crt").write_bytes(pki.ca_pem())
        port = api.url.rsplit(":", 1)[1]
        creds = in_cluster({"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}, str(sa))
        assert creds is not None and creds.server == api.url
        k = KubeClient(creds)
        assert k.list_taint_rules("a=b") == []
        (sa / "token").write_text("rotated\n")
        with pytest.raises(errors.Unauthenticated):
            k.list_taint_rules("a=b")
        api.state.token = "rotated"
        assert k.list_taint_rules("a=b") == []
        assert [r.auth for r in api.state.requests] == ["Bearer test-token", "Bearer rotated", "Bearer rotated"]
    assert in_cluster({}, str(sa)) is None
    assert in_cluster({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"}, str(tmp_path / "none")) is None


def test_errors_map_to_the_agents_classes(tmp_path: Path) -> None:
    with FakeApiServer(NODE) as api:
        k = KubeClient(from_kubeconfig(str(api.kubeconfig(tmp_path / "kc"))))
        with pytest.raises(errors.NotFound):
            k.delete_taint_rule("missing")
        with pytest.raises(errors.InvalidArgument, match="422"):
            k.create_taint_rule({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
                                 "metadata": {"name": "x"}, "spec": {"taint": {"key": "k"}}})
        api.state.problems.clear()  # that invalid body was on purpose
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    k = KubeClient(from_kubeconfig(str(_plain_kubeconfig(tmp_path / "kc2", f"http://127.0.0.1:{port}"))), timeout=2)
    with pytest.raises(errors.Unavailable, match="cannot reach"):
        k.list_taint_rules("a=b")


def _plain_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(json.dumps({
        "current-context": "c", "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    (path.parent / "token").write_text("t\n")
    return path


def test_bad_kubeconfigs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.FailedPrecondition, match="cannot read kubeconfig"):
        from_kubeconfig(str(tmp_path / "absent"))
    bad = tmp_path / "bad"
    bad.write_text("current-context: x\ncontexts: []\n")
    with pytest.raises(errors.InvalidArgument, match="no context named 'x'"):
        from_kubeconfig(str(bad))
    creds = from_kubeconfig(str(_plain_kubeconfig(tmp_path / "kc", "https://10.0.0.1:6443/")))
    assert creds.server == "https://10.0.0.1:6443" and creds.token_file == str(tmp_path / "token")


def test_unusable_tls_files_are_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    kc = tmp_path / "kc"
    kc.write_text(json.dumps({
        "current-context": "c", "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1",
                                                                      "certificate-authority": "ca.pem"}}],
        "users": [], "contexts": [{"name": "c", "context": {"cluster": "c"}}],
    }))
    with pytest.raises(errors.FailedPrecondition, match="TLS settings"):
        KubeClient(from_kubeconfig(str(kc)))
