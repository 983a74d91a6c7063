"""Which token realms the client asks, with credentials or without (docs/registry.md, "Token realms").

A realm is asked only over HTTPS at the registry's own host:port or at a
host:port named in ``registry.token-realms``, or over plain HTTP only at the
registry's own origin on loopback under plain-http. Any other realm gets no
request at all, so neither the password nor anything else leaves: the
loopback "foreign realms" here record what reaches them.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from node_agent.config.schema import RegistrySettings
from node_agent.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from node_agent.registry import Credentials, pull, push
from node_agent.registry.connection import origin_of
from node_agent.registry.reference import parse_reference
from node_agent.registry.transport import Session
from node_agent.store import Store

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.httpanswers import FakeServer, answer  # noqa: E402
from testbed.registry import Certificates, Registry  # noqa: E402

PASSWORD = "pw-that-must-stay-home"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("certs"))


def _loopback_127_0_0_2() -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.2", 0))
        except OSError:
            return False
    return True


def _token_server(handler: BaseHTTPRequestHandler) -> None:
    """A realm that would hand out a token to anyone (so that only the client's rule keeps it unasked)."""
    answer(handler, 200, json.dumps({"token": "stolen", "expires_in": 300}).encode(), {"Content-Type": "application/json"})


def _registry_pointing_at(realm: str) -> FakeServer:
    """A registry whose every request without a token gets a bearer challenge naming ``realm``."""

    def serve(handler: BaseHTTPRequestHandler) -> None:
        challenge = f'Bearer realm="{realm}",service="fake",scope="repository:ckpt/web:pull"'
        answer(handler, 401, b'{"errors": []}', {"WWW-Authenticate": challenge})

    return FakeServer(serve)


def _assert_untouched(server: FakeServer) -> None:
    assert server.seen == []


def _assert_no_password(*servers: FakeServer) -> None:
    basic = Credentials("alice", PASSWORD).basic_header()
    for server in servers:
        for _, target, headers in server.seen:
            assert PASSWORD not in target
            assert all(PASSWORD not in v and basic not in v for v in headers.values())


@pytest.mark.parametrize("kind", ["another loopback address", "another port", "another port, HTTPS", "localhost, HTTPS"])
@pytest.mark.parametrize("login", [True, False], ids=["with credentials", "anonymous"])
def test_a_foreign_realm_is_never_asked(
    tmp_path: Path, certs: Certificates, servers: list[FakeServer], caplog: pytest.LogCaptureFixture, kind: str, login: bool
) -> None:
    if kind == "another loopback address" and not _loopback_127_0_0_2():
        pytest.skip("127.0.0.2 cannot be bound here")
    host = "127.0.0.2" if kind == "another loopback address" else "127.0.0.1"
    tls = certs if "HTTPS" in kind else None
    foreign = FakeServer(_token_server, host=host, tls=tls)
    servers.append(foreign)
    name = "localhost" if kind.startswith("localhost") else host
    realm = f"{'https' if tls else 'http'}://{name}:{foreign.port}/token"
    registry = _registry_pointing_at(realm)
    servers.append(registry)
    ref = f"{registry.netloc}/ckpt/web:v1"
    creds = Credentials("alice" if login else "", PASSWORD if login else "", ca_file=certs.ca_file, plain_http=True)

    with pytest.raises(FailedPrecondition) as info:
        pull(Store(tmp_path / "dest-store"), ref, creds)

    text = str(info.value)
    assert f"registry {registry.netloc}, repository ckpt/web: refusing the token realm {realm}: " in text
    if tls:
        assert f"only at the registry's own host:port ({registry.netloc})" in text
        assert f"registry.token-realms setting; name {name}:{foreign.port} there" in text
    else:
        assert f"a plain-HTTP token realm is asked only when it is the registry's own origin (http://{registry.netloc})" in text
    assert PASSWORD not in text
    _assert_untouched(foreign)
    _assert_no_password(registry)
    assert [auth for _, _, headers in registry.seen for auth in [headers.get("Authorization")]] == [None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"pull of {ref} failed (FAILED_PRECONDITION): ")
    assert PASSWORD not in warnings[0]


def test_a_realm_named_in_token_realms_gets_the_credentials(
    tmp_path: Path, certs: Certificates, servers: list[FakeServer]
) -> None:
    """The same HTTPS realm on another port, trusted by name: it is asked, with the basic credentials, over TLS."""
    foreign = FakeServer(_token_server, tls=certs)
    servers.append(foreign)
    realm = f"https://127.0.0.1:{foreign.port}/token"
    registry = _registry_pointing_at(realm)
    servers.append(registry)
    creds = Credentials("alice", PASSWORD, ca_file=certs.ca_file, plain_http=True)
    trusted = RegistrySettings(token_realms=(f"127.0.0.1:{foreign.port}",))

    with pytest.raises(Unauthenticated, match=f"rejected the token issued by {realm}"):
        # The fake registry refuses every token; what matters is who was asked, and how.
        pull(Store(tmp_path / "dest-store"), f"{registry.netloc}/ckpt/web:v1", creds, settings=trusted)
    assert len(foreign.seen) == 1
    _, target, headers = foreign.seen[0]
    assert target.startswith("/token?service=fake&scope=repository%3Ackpt%2Fweb%3Apull&account=alice")
    assert headers["Authorization"] == creds.basic_header()


def test_a_port_is_part_of_a_trusted_realm(tmp_path: Path, certs: Certificates, servers: list[FakeServer]) -> None:
    foreign = FakeServer(_token_server, tls=certs)
    servers.append(foreign)
    registry = _registry_pointing_at(f"https://127.0.0.1:{foreign.port}/token")
    servers.append(registry)
    creds = Credentials("alice", PASSWORD, ca_file=certs.ca_file, plain_http=True)
    for entries in (("127.0.0.1",), ("127.0.0.1:443",), (f"127.0.0.2:{foreign.port}",), (f"localhost:{foreign.port}",)):
        with pytest.raises(FailedPrecondition, match="refusing the token realm"):
            pull(Store(tmp_path / "dest-store"), f"{registry.netloc}/ckpt/web:v1", creds,
                 settings=RegistrySettings(token_realms=entries))
    _assert_untouched(foreign)


def test_real_token_server_on_another_port(tmp_path: Path) -> None:
    """docker-registry with its token server on a port of its own, over TLS: refused, then trusted by name."""
    src = Store(tmp_path / "source-store")
    with src.writer() as w:
        w.add_bytes("spec.dump", b"{}")
        cid = w.commit({"kind": "test"}).id
    with Registry(tmp_path / "registry", users={"alice": PASSWORD}, token=True, tls=True, separate_token_server=True) as registry:
        tokens = registry.token_server
        assert tokens is not None and tokens.port != registry.port
        creds = Credentials("alice", PASSWORD, ca_file=registry.ca_file)
        with pytest.raises(FailedPrecondition, match=f"refusing the token realm https://127.0.0.1:{tokens.port}/token"):
            push(src, cid, registry.ref("ckpt/web:v1"), creds)
        assert tokens.requests == []

        trusted = RegistrySettings(token_realms=(f"127.0.0.1:{tokens.port}",))
        push(src, cid, registry.ref("ckpt/web:v1"), creds, settings=trusted)
        dst = Store(tmp_path / "dest-store")
        assert pull(dst, registry.ref("ckpt/web:v1"), creds, settings=trusted).checkpoint_id == cid
        assert [user for user, _ in tokens.issued] == ["alice", "alice"]
        assert all(auth == creds.basic_header() for _, auth in tokens.requests)


def _refusal(registry: str, realm: str, *, plain_http: bool = False, token_realms: tuple[str, ...] = ()) -> str | None:
    session = Session(
        parse_reference(f"{registry}/ckpt/web:v1"), Credentials(plain_http=plain_http),
        actions="pull", settings=RegistrySettings(token_realms=token_realms),
    )
    return session.realm_refusal(origin_of(realm))


@pytest.mark.parametrize(
    ("registry", "plain_http", "token_realms", "realm", "asked"),
    [
        # Plain HTTP: the registry's own origin, on loopback, under plain-http; nothing else.
        ("127.0.0.1:5000", True, (), "http://127.0.0.1:5000/token", True),
        ("localhost:5000", True, (), "http://localhost:5000/token", True),
        ("[::1]:5000", True, (), "http://[::1]:5000/token", True),
        ("127.0.0.1:5000", True, (), "http://127.0.0.1:5001/token", False),
        ("127.0.0.1:5000", True, (), "http://127.0.0.2:5000/token", False),
        ("127.0.0.1:5000", True, (), "http://localhost:5000/token", False),
        ("127.0.0.1:5000", True, ("127.0.0.1:5001",), "http://127.0.0.1:5001/token", False),
        ("10.1.2.3:5000", True, (), "http://10.1.2.3:5000/token", False),
        ("reg.example", False, (), "http://reg.example/token", False),
        # HTTPS: the registry's own host:port, or a host:port in token-realms.
        ("reg.example:5000", False, (), "https://reg.example:5000/token", True),
        ("reg.example:5000", False, (), "https://REG.Example:5000/token", True),
        ("reg.example", False, (), "https://reg.example:443/token", True),
        ("127.0.0.1:5000", True, (), "https://127.0.0.1:5000/token", True),
        ("reg.example:5000", False, (), "https://reg.example/token", False),
        ("reg.example:5000", False, ("reg.example",), "https://reg.example/token", True),
        ("reg.example", False, (), "https://auth.example/token", False),
        ("reg.example", False, ("auth.example",), "https://auth.example/token", True),
        ("reg.example", False, ("Auth.Example:443",), "https://auth.example/token", True),
        ("reg.example", False, ("auth.example",), "https://auth.example:8443/token", False),
        ("reg.example", False, ("auth.example:8443",), "https://auth.example:8443/token", True),
        ("reg.example", False, ("[::1]:8443",), "https://[::1]:8443/token", True),
        ("reg.example", False, ("auth.example",), "https://evil.auth.example/token", False),
        ("reg.example", False, ("auth.example",), "http://auth.example/token", False),
    ],
)
def test_the_realm_rule(registry: str, plain_http: bool, token_realms: tuple[str, ...], realm: str, asked: bool) -> None:
    refusal = _refusal(registry, realm, plain_http=plain_http, token_realms=token_realms)
    assert (refusal is None) == asked, refusal


@pytest.mark.parametrize("entry", ["", "https://auth.example", "auth.example/token", "alice@auth.example", "a b", "auth.example:0",
                                   "auth.example:99999", "auth.example:x"])
def test_bad_token_realm_entries_are_refused(entry: str) -> None:
    with pytest.raises(InvalidArgument, match="registry.token-realms"):
        _refusal("reg.example", "https://reg.example/token", token_realms=(entry,))
