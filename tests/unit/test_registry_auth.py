"""The decisions of node_agent.registry.auth.Authenticator, with a recording token fetcher and a fake clock."""

from __future__ import annotations

import json

import pytest

from conftest import Clock
from node_agent.errors import PermissionDenied, Unauthenticated
from node_agent.registry import Credentials
from node_agent.registry.auth import Authenticator

CHALLENGE = 'Bearer realm="https://auth.example/token",service="reg",scope="repository:ckpt/web:pull"'


class Fetcher:
    """Hands out numbered tokens and records what was asked for."""

    def __init__(self, expires_in: int = 300) -> None:
        self.calls: list[tuple[str, list[tuple[str, str]], str | None]] = []
        self.expires_in = expires_in

    def __call__(self, realm: str, query: list[tuple[str, str]], authorization: str | None) -> bytes:
        self.calls.append((realm, query, authorization))
        return json.dumps({"token": f"t{len(self.calls)}", "expires_in": self.expires_in}).encode()


def _auth(creds: Credentials, fetch: Fetcher, clock: Clock | None = None, actions: str = "pull,push") -> Authenticator:
    return Authenticator("reg.example", "ckpt/web", creds, actions, fetch, clock=clock or Clock())


def test_bearer_token_is_fetched_once_and_cached() -> None:
    fetch = Fetcher()
    auth = _auth(Credentials("alice", "pw"), fetch)
    assert auth.header() is None
    auth.challenged([CHALLENGE], None, False)
    assert auth.header() == "Bearer t1"
    assert auth.header() == "Bearer t1"
    [(realm, query, authorization)] = fetch.calls
    assert realm == "https://auth.example/token"
    # The operation's own scope (pull,push) covers the challenge's (pull): only it is asked for.
    assert query == [
        ("service", "reg"),
        ("scope", "repository:ckpt/web:pull,push"),
        ("account", "alice"),
    ]
    assert authorization == Credentials("alice", "pw").basic_header()


def test_expired_token_is_replaced_before_use() -> None:
    fetch, clock = Fetcher(expires_in=60), Clock()
    auth = _auth(Credentials("alice", "pw"), fetch, clock)
    auth.challenged([CHALLENGE], None, False)
    clock.t += 30
    assert auth.header() == "Bearer t1"
    clock.t += 30
    assert auth.header() == "Bearer t2"


def test_refused_cached_token_is_fetched_again_but_a_fresh_one_is_final() -> None:
    fetch = Fetcher()
    auth = _auth(Credentials("alice", "pw"), fetch)
    auth.challenged([CHALLENGE], None, False)
    auth.challenged([CHALLENGE + ',error="invalid_token"'], "Bearer t1", False)
    assert auth.header() == "Bearer t2"
    with pytest.raises(Unauthenticated, match="rejected the token"):
        auth.challenged([CHALLENGE + ',error="invalid_token"'], "Bearer t2", True)
    with pytest.raises(PermissionDenied, match="'alice' may not pull and push"):
        auth.challenged([CHALLENGE + ',error="insufficient_scope"'], "Bearer t2", True)


def test_anonymous_bearer() -> None:
    fetch = Fetcher()
    auth = _auth(Credentials(), fetch, actions="pull")
    auth.challenged([CHALLENGE], None, False)
    assert fetch.calls[0][2] is None
    assert ("account", "") not in fetch.calls[0][1]
    with pytest.raises(Unauthenticated, match="requires a username"):
        auth.challenged([CHALLENGE + ',error="insufficient_scope"'], "Bearer t1", True)


def test_basic() -> None:
    auth = _auth(Credentials("alice", "s3cret"), Fetcher())
    auth.challenged(['Basic realm="r"'], None, False)
    assert auth.header() == Credentials("alice", "s3cret").basic_header()
    with pytest.raises(Unauthenticated, match="rejected the password of user 'alice'") as info:
        auth.challenged(['Basic realm="r"'], auth.header(), True)
    assert "s3cret" not in str(info.value)
    with pytest.raises(Unauthenticated, match="requires a username"):
        _auth(Credentials(), Fetcher()).challenged(['Basic realm="r"'], None, False)


@pytest.mark.parametrize("values", [[], ["Negotiate"], ['Bearer service="x"']])
def test_unusable_challenges(values: list[str]) -> None:
    with pytest.raises(Unauthenticated):
        _auth(Credentials("alice", "pw"), Fetcher()).challenged(values, None, False)
