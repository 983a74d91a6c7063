"""Parsers of node_agent.registry that see hostile input: references, challenges, manifests, token answers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.errors import InvalidArgument, Unavailable
from node_agent.oci import ARTIFACT_TYPE, MAX_MANIFEST_BYTES, OCI_MANIFEST_MEDIA_TYPE
from node_agent.registry import Credentials, Reference, parse_reference
from node_agent.registry.auth import parse_challenges, parse_token_response
from node_agent.registry.pulling import parse_manifest

D1 = "sha256:" + "a" * 64
D2 = "sha256:" + "b" * 64


# -- references --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("127.0.0.1:5000/ckpt/web:v1", "127.0.0.1:5000", "ckpt/web", "v1", None),
        ("localhost/a", "localhost", "a", None, None),
        ("localhost:5000/a", "localhost:5000", "a", None, None),
        (f"registry.example.com/a/b/c@{D1}", "registry.example.com", "a/b/c", None, D1),
        (f"host.io:443/repo:tag@{D1}", "host.io:443", "repo", "tag", D1),
        ("[::1]:5000/x:latest", "[::1]:5000", "x", "latest", None),
        ("[::1]/x", "[::1]", "x", None, None),
        ("Host-1.io/a__b/c-d.e/f---g:TAG_1.x-y", "Host-1.io", "a__b/c-d.e/f---g", "TAG_1.x-y", None),
        ("h.io/" + "a" * 255, "h.io", "a" * 255, None, None),
        ("h.io/a:" + "t" * 128, "h.io", "a", "t" * 128, None),
    ],
)
def test_reference_parses(text: str, registry: str, repository: str, tag: str | None, digest: str | None) -> None:
    ref = Reference.parse(text)
    assert ref == Reference(registry, repository, tag, digest)
    assert str(ref) == text
    assert parse_reference(ref) is ref
    assert ref.name == f"{registry}/{repository}"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ckpt/web:v1",  # no registry host
        "web",
        "127.0.0.1:5000",
        "127.0.0.1:5000/",
        "127.0.0.1:99999/x",
        "127.0.0.1:0/x",
        "127.0.0.1:/x",
        "127.0.0.1:5000:6000/x",
        "-h.io/x",
        "h-.io/x",
        "h..io/x",
        "h.io/UPPER",
        "h.io/a//b",
        "h.io/a/../b",
        "h.io/./b",
        "h.io/.a",
        "h.io/a.",
        "h.io/a_",
        "h.io/a___b",
        "h.io/a b",
        "h.io/a\n",
        "h.io/a\x00b",
        "h.io/a\tb",
        "h.io/\u00e4",
        "h.io/a?x=1",
        "h.io/a#frag",
        "h.io/a%2fb",
        "h.io/a:",
        "h.io/a:-bad",
        "h.io/a:.bad",
        "h.io/a:b:c",
        "h.io/a:" + "t" * 129,
        "h.io/" + "a" * 256,
        "h.io/a@",
        "h.io/a@sha256:abc",
        "h.io/a@sha256:" + "A" * 64,
        "h.io/a@sha512:" + "a" * 128,
        "h.io/a@" + D1 + "@" + D2,
        "h.io/a@" + D1 + "x",
        "http://h.io/a",
        "[::1/x",
        "[zz]:1/x",
        "[::1]x/a",
        "[fe80::1%eth0]:5000/x",
        "h.io/" + "a/" * 600 + "a",
        "x" * 5000,
    ],
)
def test_reference_refuses(text: str) -> None:
    with pytest.raises(InvalidArgument):
        Reference.parse(text)


def test_reference_parts_are_checked_too() -> None:
    with pytest.raises(InvalidArgument):
        Reference("h.io", "../etc", None, None)
    with pytest.raises(InvalidArgument):
        Reference("h.io", "a", "v1\r\nX-Evil: 1", None)
    assert Reference("h.io", "a").with_digest(D1) == Reference.parse(f"h.io/a@{D1}")


@given(st.text(max_size=300))
def test_reference_any_text_is_refused_cleanly_or_round_trips(text: str) -> None:
    try:
        ref = Reference.parse(text)
    except InvalidArgument:
        return
    assert str(ref) == text


_component = st.from_regex(r"[a-z0-9]{1,8}([._-][a-z0-9]{1,8}){0,2}", fullmatch=True)


@given(
    st.sampled_from(["127.0.0.1:5000", "localhost", "reg.example.com", "[::1]:443"]),
    st.lists(_component, min_size=1, max_size=4),
    st.none() | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    st.none() | st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True),
)
def test_reference_well_formed_round_trips(registry: str, path: list[str], tag: str | None, digest: str | None) -> None:
    ref = Reference(registry, "/".join(path), tag, digest)
    assert Reference.parse(str(ref)) == ref


def test_credentials_hide_the_password() -> None:
    creds = Credentials("alice", "s3cret-pw")
    assert "s3cret-pw" not in repr(creds)
    assert creds.basic_header() == "Basic YWxpY2U6czNjcmV0LXB3"
    for bad in (Credentials("a:b", "x"), Credentials("alice", "pw\r\n"), Credentials("", "pw")):
        with pytest.raises(InvalidArgument):
            bad.check()


# -- WWW-Authenticate ----------------------------------------------------------------------


def test_challenges_bearer_with_quoted_commas() -> None:
    [c] = parse_challenges(
        ['Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push"']
    )
    assert c.scheme == "bearer"
    assert c.params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:a/b:pull,push",
    }


def test_challenges_several_schemes_and_escapes() -> None:
    out = parse_challenges(['Basic realm="a \\"quoted\\" realm", charset=UTF-8, Bearer realm=x error="invalid_token"'])
    assert [c.scheme for c in out] == ["basic", "bearer"]
    assert out[0].params == {"realm": 'a "quoted" realm', "charset": "UTF-8"}
    assert out[1].params == {"realm": "x", "error": "invalid_token"}


@pytest.mark.parametrize(
    "value",
    ["", ",,,", "Bearer", 'Bearer realm="unterminated', "Bearer realm=", "\x00\x01", "Negotiate abc==", "=x", "Bearer realm=a,,=b"],
)
def test_challenges_garbage_does_not_raise(value: str) -> None:
    for c in parse_challenges([value]):
        assert c.scheme


@given(st.text(max_size=200))
def test_challenges_any_text(value: str) -> None:
    parse_challenges([value])


def test_token_answer() -> None:
    assert parse_token_response(b'{"token": "abc.def-_~+/=", "expires_in": 300}', "r") == ("abc.def-_~+/=", 300.0)
    assert parse_token_response(b'{"access_token": "t"}', "r") == ("t", 60.0)
    assert parse_token_response(b'{"token": "t", "expires_in": true}', "r") == ("t", 60.0)
    for bad in (b"[]", b"nope", b'{"token": ""}', b'{"token": 5}', b'{"token": "a b"}', b'{"token": "a\\r\\nX: y"}'):
        with pytest.raises(Unavailable):
            parse_token_response(bad, "r")


# -- manifests -----------------------------------------------------------------------------


def _manifest(**changes: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": "application/vnd.node-agent.checkpoint.config.v1+json", "digest": D1, "size": 10},
        "layers": [{"mediaType": "application/vnd.node-agent.chunk.v1", "digest": D2, "size": 20}],
        "annotations": {"a": "b"},
    }
    doc.update(changes)
    return doc


def test_manifest_descriptors() -> None:
    blobs = parse_manifest(json.dumps(_manifest()).encode())
    assert [(b.digest, b.size) for b in blobs] == [(D1, 10), (D2, 20)]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b"\xff\xfe",
        b'{"schemaVersion": 2, "schemaVersion": 2}',
        b'{"schemaVersion": NaN}',
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps(_manifest(schemaVersion=1)).encode(),
        json.dumps(_manifest(schemaVersion=True)).encode(),
        json.dumps(_manifest(mediaType="application/vnd.docker.distribution.manifest.v2+json")).encode(),
        json.dumps(_manifest(artifactType="application/vnd.example.other")).encode(),
        json.dumps(_manifest(layers={})).encode(),
        json.dumps(_manifest(config=None)).encode(),
        json.dumps(_manifest(config={"mediaType": "a/b", "digest": D1, "size": -1})).encode(),
        json.dumps(_manifest(config={"mediaType": "a/b", "digest": D1, "size": 1.5})).encode(),
        json.dumps(_manifest(config={"mediaType": "a/b", "digest": D1, "size": True})).encode(),
        json.dumps(_manifest(config={"mediaType": "a/b", "digest": D1, "size": 1 << 60})).encode(),
        json.dumps(_manifest(config={"mediaType": "a/b", "digest": "sha256:../../x", "size": 1})).encode(),
        json.dumps(_manifest(config={"mediaType": "a/b", "digest": "md5:" + "a" * 32, "size": 1})).encode(),
        json.dumps(_manifest(config={"mediaType": "", "digest": D1, "size": 1})).encode(),
        json.dumps(_manifest(layers=[{"mediaType": "a/b", "digest": D2}])).encode(),
        json.dumps(_manifest(layers=["x"])).encode(),
        b" " * (MAX_MANIFEST_BYTES + 1),
    ],
)
def test_manifest_refuses(data: bytes) -> None:
    with pytest.raises(InvalidArgument):
        parse_manifest(data)
