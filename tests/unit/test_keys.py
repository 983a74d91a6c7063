"""Key domains and key sources: files, mounted Secrets, a KMS plugin; precedence, reloads, refusals."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from node_agent.config.loading import from_mapping
from node_agent.errors import FailedPrecondition, InvalidArgument
from node_agent.keys import Keys, parse_keyring


def _b64(n: int) -> str:
    return base64.b64encode(bytes([n]) * 32).decode()


def _ring(**domains: list[tuple[str, int]]) -> str:
    return json.dumps({"domains": {d: [{"id": k, "key": _b64(n)} for k, n in keys] for d, keys in domains.items()}})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _keys(settings: dict[str, object], clock: Clock | None = None) -> Keys:
    return Keys(from_mapping({"encryption": settings}).encryption, clock=clock or Clock())


def test_domains_groups_and_the_star() -> None:
    k = _keys({"domains": {"team": ["a", "b"], "rest": ["*"]}})
    assert [k.domain_of(n) for n in ("a", "b", "c")] == ["team", "team", "rest"]
    assert _keys({"domains": {"team": ["a"]}}).domain_of("c") == "c"
    assert _keys({}).seal_key("any") is None and not _keys({}).configured


def test_keyring_documents_are_checked() -> None:
    assert parse_keyring(_ring(d=[("d-2", 2), ("d-1", 1)]).encode(), "f")["d"][0].key_id == "d-2"
    bad = [
        b"[1]", b'{"domains": {"d": []}}', b'{"domains": {"d": [{"id": "x", "key": "AAAA"}]}}',
        b'{"domains": {"d": [{"id": "../x", "key": "' + _b64(1).encode() + b'"}]}}',
        b'{"domains": {"d": [{"id": "x", "key": "' + _b64(1).encode() + b'", "extra": 1}]}}',
        _ring(a=[("same", 1)], b=[("same", 2)]).encode(), b'{"other": 1}', b"{: nope",
    ]
    for doc in bad:
        with pytest.raises(InvalidArgument, match="keyring f"):
            parse_keyring(doc, "f")


def test_file_is_reread_when_it_changes_and_the_newest_key_seals(tmp_path: Path) -> None:
    ring = tmp_path / "ring.json"
    ring.write_text(_ring(ns=[("ns-1", 1)]))
    clock = Clock()
    k = _keys({"key-sources": [{"file": str(ring)}]}, clock)
    first = k.seal_key("ns")
    assert first is not None and first.key_id == "ns-1" and k.seal_key("other") is None
    ring.write_text(_ring(ns=[("ns-2", 2), ("ns-1", 1)]))
    os.utime(ring, ns=(1, 1))
    clock.now += 2
    new = k.seal_key("ns")
    assert new is not None and new.key_id == "ns-2"
    assert k.key("ns-1") == first  # old checkpoints keep opening
    assert "ns-2" in " ".join(k.describe()) and _b64(2) not in " ".join(k.describe())


def test_a_broken_source_keeps_its_keys_and_a_never_read_one_refuses(tmp_path: Path) -> None:
    ring = tmp_path / "ring.json"
    ring.write_text(_ring(ns=[("ns-1", 1)]))
    clock = Clock()
    k = _keys({"key-sources": [{"file": str(ring)}]}, clock)
    ring.write_text("{broken")
    clock.now += 2
    assert (key := k.seal_key("ns")) is not None and key.key_id == "ns-1"
    missing = _keys({"key-sources": [{"file": str(tmp_path / "absent.json")}]})
    with pytest.raises(FailedPrecondition, match="refusing to write a checkpoint of namespace ns .*unencrypted"):
        missing.seal_key("ns")
    assert missing.key("ns-1") is None


def test_mounted_secret_swap_is_seen(tmp_path: Path) -> None:
    mount = tmp_path / "secret"
    mount.mkdir()
    for gen, ring in (("..2026_1", _ring(ns=[("ns-1", 1)])), ("..2026_2", _ring(ns=[("ns-2", 2), ("ns-1", 1)]))):
        (mount / gen).mkdir()
        (mount / gen / "keyring.yaml").write_text(ring)
    os.symlink("..2026_1", mount / "..data")
    os.symlink("..data/keyring.yaml", mount / "keyring.yaml")
    clock = Clock()
    k = _keys({"key-sources": [{"secret": str(mount)}]}, clock)
    assert (key := k.seal_key("ns")) is not None and key.key_id == "ns-1"
    os.symlink("..2026_2", mount / "..data.tmp")
    os.replace(mount / "..data.tmp", mount / "..data")  # what the kubelet does
    clock.now += 2
    assert (key := k.seal_key("ns")) is not None and key.key_id == "ns-2"


def test_plugin_is_asked_again_for_a_missing_key_and_sources_keep_their_order(tmp_path: Path) -> None:
    count = tmp_path / "count"
    plugin = tmp_path / "kms"
    later = _ring(ns=[("ns-new", 9)], shared=[("shared-1", 7)])
    plugin.write_text(
        "#!/bin/sh\n"
        f"echo x >> {count}\n"
        f"if [ -e {tmp_path}/rotated ]; then echo '{later}'; else echo '{_ring(ns=[('ns-old', 8)])}'; fi\n"
    )
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    ring = tmp_path / "ring.json"
    ring.write_text(_ring(ns=[("ns-file", 1)], shared=[("shared-1", 3)], other=[("other-1", 4)]))
    clock = Clock()
    k = _keys({"key-sources": [{"exec": [str(plugin)]}, {"file": str(ring)}], "refresh-interval": 60}, clock)
    assert (key := k.seal_key("ns")) is not None and key.key_id == "ns-old"  # the first source wins the domain
    assert (key := k.seal_key("other")) is not None and key.key_id == "other-1"  # the second has that one
    (tmp_path / "rotated").write_text("")
    assert k.key("ns-new") is None  # asked too soon after the last run
    clock.now += 11
    found = k.key("ns-new")
    assert found is not None and found.secret == bytes([9]) * 32
    runs = len(count.read_text().split())
    assert runs == 2
    shared = k.key("shared-1")
    assert shared is not None and shared.secret == bytes([7]) * 32  # the earlier source's bytes win


def test_plugin_failures_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plugin = tmp_path / "kms"
    plugin.write_text("#!/bin/sh\necho 'kms says no' >&2\nexit 3\n")
    plugin.chmod(0o700)
    k = _keys({"key-sources": [{"exec": [str(plugin)]}]})
    with pytest.raises(FailedPrecondition, match="exited with 3: kms says no"):
        k.seal_key("ns")


def test_key_sources_are_checked_in_the_config() -> None:
    for settings, match in (
        ({"key-sources": [{}]}, "exactly one of file, secret, exec"),
        ({"key-sources": [{"file": "/a", "secret": "/b"}]}, "exactly one"),
        ({"key-sources": [{"file": "rel"}]}, "absolute path"),
        ({"key-sources": [{"exec": ["kms"]}]}, "absolute path"),
        ({"domains": {"a": ["x"], "b": ["x"]}}, "in both"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            from_mapping({"encryption": settings})
