"""The node's registry logins from a docker config.json, matched as the kubelet's credential keyring matches them.

Each case writes a config file under tmp_path and asks for images; a change to
the file is forced with explicit os.utime nanoseconds, never by waiting.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from node_agent.errors import InvalidArgument
from node_agent.registry.dockerconfig import MAX_CONFIG_BYTES, Login, NodeCredentials

SECRET = "pw-that-must-stay-home"
LOGGER = "node_agent.registry.dockerconfig"
DIGEST = "sha256:" + "c" * 64


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


def auth(user: str, password: str = SECRET) -> dict[str, str]:
    return {"auth": b64(f"{user}:{password}")}


def write(path: Path, doc: Any, *, ns: int | None = None) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    if ns is not None:
        os.utime(path, ns=(ns, ns))
    return path


def keyring(tmp_path: Path, auths: dict[str, Any], **top: Any) -> NodeCredentials:
    return NodeCredentials(str(write(tmp_path / "config.json", {"auths": auths, **top})))


def user_of(creds: NodeCredentials, image: str) -> str | None:
    login = creds.lookup(image)
    return None if login is None else login.username


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def assert_no_secret(text: str) -> None:
    for secret in (SECRET, b64(f"alice:{SECRET}"), b64(f"bob:{SECRET}")):
        assert secret not in text


# -- the two forms of an entry ------------------------------------------------------------


def test_auth_form_gives_username_and_password(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"quay.io": auth("alice")})
    assert creds.lookup("quay.io/team/app") == Login("alice", SECRET)


def test_username_and_password_form(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"quay.io": {"username": "bob", "password": SECRET, "email": "bob@example.com"}})
    assert creds.lookup("quay.io/team/app") == Login("bob", SECRET)


def test_auth_may_be_unpadded_and_the_password_may_hold_colons(tmp_path: Path) -> None:
    unpadded = b64("carol:a:b:c").rstrip("=")
    assert not unpadded.endswith("=")
    creds = keyring(tmp_path, {"quay.io": {"auth": unpadded}})
    assert creds.lookup("quay.io/app") == Login("carol", "a:b:c")


def test_both_forms_must_agree(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    creds = keyring(
        tmp_path,
        {
            "agree.example.com": {**auth("alice"), "username": "alice", "password": SECRET},
            "user.example.com": {**auth("alice"), "username": "mallory"},
            "password.example.com": {**auth("alice"), "password": SECRET + "-other"},
        },
    )
    assert creds.lookup("agree.example.com/app") == Login("alice", SECRET)
    assert creds.lookup("user.example.com/app") is None
    assert creds.lookup("password.example.com/app") is None
    told = warnings(caplog)
    assert any("'user.example.com'" in w and '"username" and "auth" disagree' in w for w in told)
    assert any("'password.example.com'" in w and '"password" and "auth" disagree' in w for w in told)
    assert_no_secret(caplog.text)


# -- how keys are normalised and matched ----------------------------------------------------


def test_scheme_and_v1_v2_paths_are_dropped_from_keys(tmp_path: Path) -> None:
    creds = keyring(
        tmp_path,
        {
            "https://quay.io": auth("quay"),
            "http://r.example.com:5000/v2/": auth("r5000"),
            "https://ghcr.io/v1/team": auth("ghcr-team"),
        },
    )
    assert user_of(creds, "quay.io/a/b") == "quay"
    assert user_of(creds, "r.example.com:5000/app") == "r5000"
    assert user_of(creds, "ghcr.io/team/app") == "ghcr-team"
    assert user_of(creds, "ghcr.io/other/app") is None


def test_the_port_must_match_exactly(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"r.example.com:5000": auth("with-port"), "s.example.com": auth("no-port")})
    assert user_of(creds, "r.example.com:5000/app") == "with-port"
    assert user_of(creds, "r.example.com/app") is None
    assert user_of(creds, "r.example.com:5001/app") is None
    assert user_of(creds, "s.example.com/app") == "no-port"
    assert user_of(creds, "s.example.com:443/app") is None


def test_a_port_is_not_taken_for_a_tag(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"localhost:5000": auth("local")})
    assert user_of(creds, "localhost:5000/app") == "local"
    assert user_of(creds, "localhost:5000/app:v1") == "local"
    assert user_of(creds, f"localhost:5000/team/app:v1@{DIGEST}") == "local"


def test_wildcards_match_one_host_part_each(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"*.example.com": auth("wild"), "mirror[0-9].example.org": auth("mirror")})
    assert user_of(creds, "a.example.com/app") == "wild"
    assert user_of(creds, "a.b.example.com/app") is None
    assert user_of(creds, "example.com/app") is None
    assert user_of(creds, "a.example.com:5000/app") is None
    assert user_of(creds, "mirror7.example.org/app") == "mirror"
    assert user_of(creds, "mirrorx.example.org/app") is None


def test_the_most_specific_key_wins(tmp_path: Path) -> None:
    creds = keyring(
        tmp_path,
        {
            "*.example.com": auth("wild"),
            "a.example.com": auth("host"),
            "a.example.com/team": auth("team"),
            "a.example.com/team/app": auth("app"),
        },
    )
    assert user_of(creds, "a.example.com/team/app") == "app"
    assert user_of(creds, "a.example.com/team/other") == "team"
    assert user_of(creds, "a.example.com/elsewhere/x") == "host"
    assert user_of(creds, "b.example.com/team/app") == "wild"


def test_a_key_path_is_a_string_prefix_as_in_the_kubelet(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"quay.io/team": auth("team")})
    assert user_of(creds, "quay.io/team/app") == "team"
    assert user_of(creds, "quay.io/teamwork/app") == "team"
    assert user_of(creds, "quay.io/other/app") is None


def test_hosts_compare_with_case_as_in_the_kubelet(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"Quay.io": auth("upper")})
    assert user_of(creds, "quay.io/app") is None
    assert user_of(creds, "Quay.io/app") == "upper"


# -- Docker Hub -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image",
    ["busybox", "busybox:1.36", "library/busybox", "team/app", "docker.io/team/app", "index.docker.io/team/app"],
)
def test_the_index_docker_io_key_serves_docker_hub_images(tmp_path: Path, image: str) -> None:
    creds = keyring(tmp_path, {"https://index.docker.io/v1/": auth("hub")})
    assert user_of(creds, image) == "hub"


def test_the_docker_hub_login_goes_to_no_other_registry(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"index.docker.io": auth("hub")})
    assert user_of(creds, "localhost/app") is None
    assert user_of(creds, "quay.io/app") is None
    assert user_of(creds, "MyRegistry/app") is None


def test_a_docker_io_key_and_docker_io_paths(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"docker.io": auth("hub"), "docker.io/library": auth("official")})
    assert user_of(creds, "busybox") == "official"
    assert user_of(creds, "docker.io/library/busybox:1") == "official"
    assert user_of(creds, "team/app") == "hub"
    assert user_of(creds, "index.docker.io/team/app") == "hub"


def test_a_matching_key_comes_before_the_docker_hub_fallback(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"index.docker.io": auth("index"), "docker.io/team": auth("team")})
    assert user_of(creds, "team/app") == "team"
    assert user_of(creds, "other/app") == "index"


# -- what is refused ------------------------------------------------------------------------------


BAD_ENTRIES: dict[str, Any] = {
    "not-object.example.com": "alice:" + SECRET,
    "auth-type.example.com": {"auth": 12},
    "username-type.example.com": {"username": ["alice"], "password": SECRET},
    "password-type.example.com": {"username": "alice", "password": 7},
    "email-type.example.com": {**auth("alice"), "email": False},
    "bad-base64.example.com": {"auth": "!!" + SECRET},
    "bad-padding.example.com": {"auth": "YWxpY2U6cHc="[:-2] + "="},
    "no-colon.example.com": {"auth": b64("alice" + SECRET)},
    "not-utf8.example.com": {"auth": base64.b64encode(b"alice:\xff\xfe").decode()},
    "newline-password.example.com": auth("alice", SECRET + "\n"),
    "cr-username.example.com": {"username": "ali\rce", "password": SECRET},
    "nul-password.example.com": {"username": "alice", "password": SECRET + "\0"},
    "colon-username.example.com": {"username": "ali:ce", "password": SECRET},
    "no-username.example.com": {"password": SECRET},
    "empty.example.com": {},
    "identity-token.example.com": {"identitytoken": SECRET},
    "ftp://scheme.example.com": auth("alice"),
    "alice:" + SECRET + "@userinfo.example.com": auth("alice"),
    "query.example.com?token=" + SECRET: auth("alice"),
    "space host.example.com": auth("alice"),
    "empty..part.example.com": auth("alice"),
    "bad-port.example.com:99999": auth("alice"),
    "empty-port.example.com:": auth("alice"),
    "[::1]": auth("alice"),
    "[not-v6]:5000": auth("alice"),
    "glob[.example.com": auth("alice"),
    "": auth("alice"),
}


def test_bad_entries_are_skipped_and_the_good_ones_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    creds = keyring(tmp_path, {**BAD_ENTRIES, "good.example.com": auth("bob"), "[::1]:5000": auth("v6")})
    assert creds.lookup("good.example.com/app") == Login("bob", SECRET)
    assert user_of(creds, "[::1]:5000/app") == "v6"
    for key in BAD_ENTRIES:
        host = key.split("://")[-1].split("?")[0].split("@")[-1]
        if host.endswith(".example.com") and not any(mark in host for mark in (" ", "[", "..")):
            assert creds.lookup(host + "/app") is None, key
    told = warnings(caplog)
    assert len(told) == len(BAD_ENTRIES)
    for key in BAD_ENTRIES:
        if "@" not in key and "?" not in key:
            assert any(repr(key) in w for w in told), key
    assert_no_secret(caplog.text)
    assert any("'...@userinfo.example.com'" in w for w in told)


def test_a_second_entry_for_the_same_registry_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    creds = keyring(tmp_path, {"https://quay.io": auth("first"), "quay.io/v2/": auth("second")})
    assert user_of(creds, "quay.io/app") == "first"
    assert any("'quay.io/v2/'" in w and "earlier entry" in w for w in warnings(caplog))


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{not json", "is not JSON (line 1, column 2)"),
        (b"\xff\xfe{}", "is not UTF-8"),
        ("[" * 100_000 + "]" * 100_000, "no logins are used"),
        ('["auths"]', "is not a JSON object"),
        ('{"auths": ["quay.io"]}', '"auths" that is not a JSON object'),
    ],
)
def test_a_file_of_the_wrong_shape_gives_no_logins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str | bytes, said: str
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    creds = NodeCredentials(str(path))
    assert creds.lookup("quay.io/app") is None
    assert creds.lookup("quay.io/app") is None
    told = warnings(caplog)
    assert len(told) == 1 and said in told[0]


def test_a_file_over_the_limit_gives_no_logins(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    doc = json.dumps({"auths": {"quay.io": auth("alice")}})
    path = tmp_path / "config.json"
    path.write_text(doc + " " * (MAX_CONFIG_BYTES + 1 - len(doc)), encoding="utf-8")
    assert path.stat().st_size == MAX_CONFIG_BYTES + 1
    assert NodeCredentials(str(path)).lookup("quay.io/app") is None
    assert any(f"larger than {MAX_CONFIG_BYTES} bytes" in w for w in warnings(caplog))
    path.write_text(doc + " " * (MAX_CONFIG_BYTES - len(doc)), encoding="utf-8")
    assert user_of(NodeCredentials(str(path)), "quay.io/app") == "alice"


def test_no_auths_means_no_logins_and_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    creds = NodeCredentials(str(write(tmp_path / "config.json", {"HttpHeaders": {"User-Agent": "x"}})))
    assert creds.lookup("quay.io/app") is None
    assert warnings(caplog) == []


@pytest.mark.parametrize(
    "image", ["", " quay.io/app", "quay.io/App", "quay.io:http/app", "quay.io:0/app", "[zz]:5000/app", "a..b/app"]
)
def test_a_malformed_image_is_refused(tmp_path: Path, image: str) -> None:
    creds = keyring(tmp_path, {"quay.io": auth("alice")})
    with pytest.raises(InvalidArgument) as caught:
        creds.lookup(image)
    assert_no_secret(str(caught.value))


# -- secrets ----------------------------------------------------------------------------------


def test_secrets_stay_out_of_reprs_and_errors(tmp_path: Path) -> None:
    login = Login("alice", SECRET)
    creds = keyring(tmp_path, {"quay.io": auth("alice")})
    assert creds.lookup("quay.io/app") == login
    for text in (repr(login), str(login), repr(creds), repr([login])):
        assert_no_secret(text)
    assert "alice" in repr(login)
    for bad in (("alice", SECRET + "\r"), ("al:ice", SECRET), ("", SECRET)):
        with pytest.raises(InvalidArgument) as caught:
            Login(*bad)
        assert_no_secret(str(caught.value))


# -- the file: missing, unreadable, changed ------------------------------------------------------


def test_a_missing_file_means_no_logins_until_it_appears(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    path = tmp_path / "config.json"
    creds = NodeCredentials(str(path))
    assert creds.lookup("quay.io/app") is None
    assert NodeCredentials(str(tmp_path / "absent" / "config.json")).lookup("quay.io/app") is None
    write(path, {"auths": {"quay.io": auth("alice")}})
    assert user_of(creds, "quay.io/app") == "alice"
    path.unlink()
    assert creds.lookup("quay.io/app") is None
    assert warnings(caplog) == []


def test_an_unreadable_file_warns_once_and_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    path = write(tmp_path / "config.json", {"auths": {"quay.io": auth("alice")}})
    real_open = os.open

    def refuse(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, flags, *args, **kwargs)

    creds = NodeCredentials(str(path))
    monkeypatch.setattr(os, "open", refuse)
    assert creds.lookup("quay.io/app") is None
    assert creds.lookup("quay.io/app") is None
    told = warnings(caplog)
    assert len(told) == 1 and "cannot be read (EACCES)" in told[0] and str(path) in told[0]
    monkeypatch.undo()
    assert user_of(creds, "quay.io/app") == "alice"


def test_a_directory_is_not_a_config_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    creds = NodeCredentials(str(tmp_path))
    assert creds.lookup("quay.io/app") is None
    assert creds.lookup("quay.io/app") is None
    told = warnings(caplog)
    assert len(told) == 1 and "is not a regular file" in told[0]


def test_the_file_is_read_again_only_when_mtime_size_or_inode_change(tmp_path: Path) -> None:
    path = write(tmp_path / "config.json", {"auths": {"quay.io": auth("alice")}}, ns=1_000_000_000_000_000_000)
    creds = NodeCredentials(str(path))
    assert user_of(creds, "quay.io/app") == "alice"
    inode = path.stat().st_ino

    # Same size, same inode, same mtime: not read again.
    write(path, {"auths": {"quay.io": auth("carol")}}, ns=1_000_000_000_000_000_000)
    assert path.stat().st_ino == inode
    assert user_of(creds, "quay.io/app") == "alice"

    # Only the mtime changes: read again.
    os.utime(path, ns=(1_000_000_000_000_000_001, 1_000_000_000_000_000_001))
    assert user_of(creds, "quay.io/app") == "carol"

    # Only the size changes.
    size = path.stat().st_size
    write(path, {"auths": {"quay.io": auth("dave")}}, ns=1_000_000_000_000_000_001)
    assert path.stat().st_size != size
    assert user_of(creds, "quay.io/app") == "dave"

    # Only the inode changes (a new file renamed over the old one, same size and mtime).
    fresh = write(tmp_path / "fresh.json", {"auths": {"quay.io": auth("erin")}}, ns=1_000_000_000_000_000_001)
    assert fresh.stat().st_size == path.stat().st_size
    os.replace(fresh, path)
    assert path.stat().st_ino != inode
    assert user_of(creds, "quay.io/app") == "erin"


def test_helpers_are_named_once_and_never_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    path = tmp_path / "config.json"
    doc = {"auths": {"quay.io": auth("alice")}, "credsStore": "desktop", "credHelpers": {"gcr.io": "gcloud"}}
    write(path, doc, ns=2_000_000_000_000_000_000)
    creds = NodeCredentials(str(path))
    assert user_of(creds, "quay.io/app") == "alice"
    assert creds.lookup("gcr.io/project/app") is None
    write(path, doc, ns=2_000_000_000_000_000_001)
    assert user_of(creds, "quay.io/app") == "alice"
    told = warnings(caplog)
    assert len(told) == 2
    assert any('"credsStore"' in w for w in told) and any('"credHelpers"' in w for w in told)
    assert all("desktop" not in w and "gcloud" not in w for w in told)


def test_lookups_from_many_threads_agree(tmp_path: Path) -> None:
    creds = keyring(tmp_path, {"quay.io": auth("alice"), "*.example.com": auth("wild")})
    seen: list[tuple[str | None, str | None]] = []
    lock = threading.Lock()

    def ask() -> None:
        for _ in range(200):
            pair = (user_of(creds, "quay.io/app"), user_of(creds, "a.example.com/app"))
            with lock:
                seen.append(pair)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(seen) == {("alice", "wild")} and len(seen) == 1600


def test_the_path_must_be_a_string(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        NodeCredentials("")
    assert repr(NodeCredentials(str(tmp_path / "c.json"))) == f"NodeCredentials({str(tmp_path / 'c.json')!r})"
