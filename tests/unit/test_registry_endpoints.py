"""Where a repository's requests go (``endpoints``): hosts.toml's mirrors, then the registry, and whose login where.

Small loopback HTTP servers play the mirror and the registry and record every request; a port bound but
not listening is a host that is down. A login goes only to the host it belongs to: the request's own to
the registry its reference names, the node's (a kubelet-format config.json) to each host by that host's
entry, and none of the node's where the caller does not allow them.
"""

from __future__ import annotations

import base64
import json
import socket
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import quote

import pytest

from node_agent.errors import NotFound, Unavailable
from node_agent.registry.auth import Credentials
from node_agent.registry.endpoints import RegistryAccess, Route
from node_agent.registry.reference import parse_reference
from node_agent.registry.transport import Session

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.httpanswers import FakeServer, answer  # noqa: E402
from testbed.layout import write_hosts_toml  # noqa: E402


def _ok(handler: BaseHTTPRequestHandler) -> None:
    answer(handler, 200, b"here")


def _missing(handler: BaseHTTPRequestHandler) -> None:
    answer(handler, 404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', {"Content-Type": "application/json"})


@pytest.fixture
def down() -> Iterator[str]:
    """``127.0.0.1:PORT`` bound and not listening: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _get(session: Session) -> str:
    url = session.url(f"/v2/{session.ref.repository}/manifests/v1")
    with session.request("GET", url, "getting it") as resp:
        if resp.status == 404:
            raise NotFound(f"{session.where}: not there")
        if resp.status != 200:
            raise resp.error("getting it")
        return f"{session.host.host}:{resp.read(100, 'body').decode()}"


def _auth(headers: dict[str, str]) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == "authorization"), None)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_the_mirror_answers_first_with_its_headers_and_ns(tmp_path: Path, servers: list[FakeServer]) -> None:
    mirror, registry = FakeServer(_ok), FakeServer(_ok)
    servers += [mirror, registry]
    write_hosts_toml(tmp_path, registry.netloc, (
        f'server = "http://{registry.netloc}"\n'
        f'[host."http://{mirror.netloc}"]\n  capabilities = ["pull", "resolve"]\n'
        f'  [host."http://{mirror.netloc}".header]\n    X-Tenant = "blue"\n'))
    ref = parse_reference(f"{registry.netloc}/team/app:v1")
    endpoints = RegistryAccess(str(tmp_path)).endpoints(ref, "resolve", Credentials())
    assert [e.name for e in endpoints] == [f"http://{mirror.netloc}", f"http://{registry.netloc}"]
    with Route(ref, endpoints, actions="pull") as route:
        assert route.run(_get) == f"{mirror.netloc}:here"
    [(method, target, headers)] = mirror.seen
    assert method == "GET" and target == f"/v2/team/app/manifests/v1?ns={quote(registry.netloc, safe='')}"
    assert headers.get("X-Tenant") == "blue"
    assert registry.seen == []


def test_a_mirror_that_is_down_or_lacks_it_leaves_the_request_to_the_next_host(
    tmp_path: Path, servers: list[FakeServer], down: str
) -> None:
    empty, registry = FakeServer(_missing), FakeServer(_ok)
    servers += [empty, registry]
    write_hosts_toml(tmp_path, registry.netloc, (
        f'server = "http://{registry.netloc}"\n[host."http://{down}"]\n[host."http://{empty.netloc}"]\n'))
    ref = parse_reference(f"{registry.netloc}/team/app:v1")
    with Route(ref, RegistryAccess(str(tmp_path)).endpoints(ref, "pull", Credentials()), actions="pull") as route:
        assert route.run(_get) == f"{registry.netloc}:here"
        assert len(empty.seen) == 1 and len(registry.seen) == 1
        # The host that was down is passed over by the route's next requests; the one without it is asked again.
        assert route.run(_get) == f"{registry.netloc}:here"
        assert len(empty.seen) == 2 and len(registry.seen) == 2


def test_when_every_host_fails_the_error_is_the_registrys_naming_the_others(
    tmp_path: Path, servers: list[FakeServer], down: str
) -> None:
    empty = FakeServer(_missing)
    servers.append(empty)
    write_hosts_toml(tmp_path, down, f'server = "http://{down}"\n[host."http://{empty.netloc}"]\n')
    ref = parse_reference(f"{down}/team/app:v1")
    with Route(ref, RegistryAccess(str(tmp_path)).endpoints(ref, "pull", Credentials()), actions="pull") as route:
        with pytest.raises(Unavailable) as info:
            route.run(_get)
    text = str(info.value)
    assert f"registry {down}" in text and f"tried first: http://{empty.netloc}: NOT_FOUND" in text, text


def test_a_mirror_without_resolve_never_turns_a_tag_into_a_digest(tmp_path: Path, servers: list[FakeServer]) -> None:
    mirror, registry = FakeServer(_ok), FakeServer(_ok)
    servers += [mirror, registry]
    write_hosts_toml(tmp_path, registry.netloc, (
        f'server = "http://{registry.netloc}"\n[host."http://{mirror.netloc}"]\n  capabilities = ["pull"]\n'))
    ref = parse_reference(f"{registry.netloc}/team/app:v1")
    access = RegistryAccess(str(tmp_path))
    assert [e.host.host for e in access.endpoints(ref, "resolve", Credentials())] == [registry.netloc]
    assert [e.host.host for e in access.endpoints(ref, "pull", Credentials())] == [mirror.netloc, registry.netloc]
    assert [e.host.host for e in access.endpoints(ref, "push", Credentials())] == [registry.netloc]


def test_each_login_goes_only_to_the_host_it_belongs_to(tmp_path: Path) -> None:
    registry, mirror, other = "127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"
    config = tmp_path / "certs.d"
    write_hosts_toml(config, registry, f'server = "http://{registry}"\n[host."http://{mirror}"]\n')
    logins = tmp_path / "config.json"
    logins.write_text(json.dumps({"auths": {
        registry: {"auth": base64.b64encode(b"node:registry-pw").decode()},
        mirror: {"auth": base64.b64encode(b"node:mirror-pw").decode()},
        other: {"auth": base64.b64encode(b"node:other-pw").decode()},
    }}))
    access = RegistryAccess(str(config), str(logins))
    ref = parse_reference(f"{registry}/team/app:v1")

    def who(given: Credentials, node_logins: bool = True) -> list[tuple[str, str, str]]:
        return [(e.host.host, e.creds.username, e.creds.password)
                for e in access.endpoints(ref, "pull", given, node_logins=node_logins)]

    assert who(Credentials()) == [(mirror, "node", "mirror-pw"), (registry, "node", "registry-pw")]
    # A request's own login is for the registry it names; the mirror keeps the node's own for it.
    assert who(Credentials("alice", "alice-pw")) == [(mirror, "node", "mirror-pw"), (registry, "alice", "alice-pw")]
    # Where the caller may not use the node's logins (a Pod's reference outside restore.pod-credentials): none.
    assert who(Credentials(), node_logins=False) == [(mirror, "", ""), (registry, "", "")]


def test_the_nodes_login_is_sent_where_the_request_brings_none(
    tmp_path: Path, servers: list[FakeServer]
) -> None:
    def private(handler: BaseHTTPRequestHandler) -> None:
        if _auth(dict(handler.headers.items())) != _basic("node", "pw"):
            answer(handler, 401, b"{}", {"WWW-Authenticate": 'Basic realm="private"'})
        else:
            answer(handler, 200, b"here")

    registry = FakeServer(private)
    servers.append(registry)
    logins = tmp_path / "config.json"
    logins.write_text(json.dumps({"auths": {f"http://{registry.netloc}": {"username": "node", "password": "pw"}}}))
    ref = parse_reference(f"{registry.netloc}/team/app:v1")
    # No hosts configured: HTTPS, verified, even on loopback (no implicit plain-HTTP fallback).
    access = RegistryAccess(str(tmp_path / "none"), str(logins))
    assert [e.name for e in access.endpoints(ref, "pull", Credentials())] == [f"https://{registry.netloc}"]
    # plain-http on the request: the registry over plain HTTP; the node's login goes with it.
    endpoints = access.endpoints(ref, "pull", Credentials(plain_http=True))
    assert [e.name for e in endpoints] == [f"http://{registry.netloc}"]
    with Route(ref, endpoints, actions="pull") as route:
        assert route.run(_get) == f"{registry.netloc}:here"
    assert [_auth(h) for _, _, h in registry.seen if _auth(h)] == [_basic("node", "pw")]
