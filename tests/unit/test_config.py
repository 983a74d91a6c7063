from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.config.loading import load
from node_agent.config.schema import Settings
from node_agent.errors import InvalidArgument


def test_defaults_match_the_documented_flags() -> None:
    s = Settings()
    assert s.cri_endpoint == "unix:///run/containerd/containerd.sock"
    assert s.socket == "/run/node-agent/agent.sock"
    assert s.store == "/var/lib/node-agent"
    assert s.runtime_handler == "criu"
    assert s.runc_root == "/run/containerd/runc/k8s.io"


def test_chunk_size_is_the_stores_and_bounded(tmp_path: Path) -> None:
    from node_agent.config import schema
    from node_agent.store import DEFAULT_CHUNK_SIZE
    from node_agent.store.chunking import MAX_AVERAGE, MIN_AVERAGE

    assert Settings().chunk_size == schema.CHUNK_SIZE_DEFAULT == DEFAULT_CHUNK_SIZE
    assert MIN_AVERAGE <= schema.CHUNK_SIZE_MIN and schema.CHUNK_SIZE_MAX == MAX_AVERAGE
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk-size: 1048576\n")
    assert load(str(cfg), {}).chunk_size == 1 << 20
    for bad in (1 << 10, 8 << 20):
        cfg.write_text(f"chunk-size: {bad}\n")
        with pytest.raises(InvalidArgument, match="chunk-size"):
            load(str(cfg), {})


def test_file_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store: /srv/na\nruntime-handler: restore\ntimeouts:\n  max-freeze: 5\n")
    s = load(str(cfg), {"runtime_handler": "other", "socket": None})
    assert s.store == "/srv/na"
    assert s.runtime_handler == "other"
    assert s.timeouts.max_freeze == 5.0
    assert s.plans_dir == "/srv/na/plans"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("bogus: 1\n", "unknown config key 'bogus'"),
        ("timeouts:\n  nope: 1\n", "timeouts.nope"),
        ("store: relative/dir\n", "absolute"),
        ("timeouts:\n  checkpoint: -1\n", "positive"),
        ("log-format: xml\n", "log-format"),
        ("- a\n- b\n", "mapping"),
        ("runtime-handler: 'a b'\n", "handler"),
        ("min-free-bytes: lots\n", "integer"),
    ],
)
def test_bad_config_is_refused(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(InvalidArgument, match=needle):
        load(str(cfg))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        load(str(tmp_path / "absent.yaml"))


def test_lazy_restore_setting(tmp_path: Path) -> None:
    assert Settings().lazy_restore == "auto" and Settings().timeouts.lazy_start == 600.0
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lazy-restore: never\ntimeouts:\n  lazy-start: 30\n")
    s = load(str(cfg))
    assert s.lazy_restore == "never" and s.timeouts.lazy_start == 30.0
    cfg.write_text("lazy-restore: sometimes\n")
    with pytest.raises(InvalidArgument, match="config key 'lazy-restore': must be one of auto, never, got 'sometimes'"):
        load(str(cfg))


def test_lazy_fetch_and_after_failed_restore_settings(tmp_path: Path) -> None:
    s = Settings()
    assert s.timeouts.lazy_fetch == 60.0 and s.restore.after_failed_restore == "refuse"
    assert s.replicas_dir == "/var/lib/node-agent/replicas"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("timeouts:\n  lazy-fetch: 5\nrestore:\n  after-failed-restore: start-fresh\n")
    s = load(str(cfg))
    assert s.timeouts.lazy_fetch == 5.0 and s.restore.after_failed_restore == "start-fresh"
    cfg.write_text("restore:\n  after-failed-restore: retry\n")
    with pytest.raises(InvalidArgument, match="restore.after-failed-restore.*refuse, start-fresh.*'retry'"):
        load(str(cfg))
    cfg.write_text("timeouts:\n  lazy-fetch: 0\n")
    with pytest.raises(InvalidArgument, match="timeouts.lazy-fetch"):
        load(str(cfg))


def test_non_ascii_digits_are_not_a_port() -> None:
    from node_agent.config.validation import host_port

    with pytest.raises(InvalidArgument):
        host_port("127.0.0.1:\u00b2")  # "²".isdigit() is True, int("²") is not


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf", "1e400"])
def test_timeouts_are_finite(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "c.yaml"
    for doc in (f"timeouts:\n  cleanup: {text}\n", f"devices:\n  clear-seconds: {text}\n"):
        cfg.write_text(doc)
        with pytest.raises(InvalidArgument) as e:
            load(str(cfg))
        assert "finite" in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("devices:\n  raise-polls: 0\n", "config key 'devices.raise-polls': must be an integer of at least 1, got 0"),
        ("devices:\n  xid-ignore: [13, x]\n", "config key 'devices.xid-ignore[1]': must be an integer, got 'x'"),
        ("retention:\n  gc-interval: 1.5\n", "config key 'retention.gc-interval': must be a non-negative integer, got 1.5"),
        ("log-level: loud\n", "config key 'log-level': must be one of debug, info, warning, error, got 'loud'"),
        ("metrics-listen: [9100]\n", "config key 'metrics-listen': must be HOST:PORT or a port, got [9100]"),
        ("timeouts: 5\n", "config key 'timeouts': must be a mapping, got 5"),
        ("devices:\n  1: 2\n", "config key 'devices': every key must be a string"),
    ],
)
def test_a_refusal_names_the_key_what_it_takes_and_what_it_got(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(InvalidArgument) as e:
        load(str(cfg))
    assert str(e.value) == message


def test_an_empty_file_sets_nothing_and_flags_take_what_their_keys_take(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("")
    assert load(str(cfg)) == Settings(config_file=str(cfg))
    assert load(None, {"metrics_listen": "9100", "log_level": "debug"}).metrics_listen == "9100"
    with pytest.raises(InvalidArgument, match="config key 'log-level': must be one of"):
        load(None, {"log_level": "loud"})
    with pytest.raises(InvalidArgument, match="unknown settings: bogus"):
        load(None, {"bogus": 1})
    with pytest.raises(InvalidArgument, match="unknown config key 'config-file'"):
        cfg.write_text("config-file: /elsewhere.yaml\n")
        load(str(cfg))


def test_settings_stay_frozen() -> None:
    s = Settings()
    with pytest.raises(AttributeError):
        s.store = "/elsewhere"  # type: ignore[misc]
    assert hash(s) == hash(Settings()) and s == Settings()
