"""The `registry:` section of the agent's config, and the registry client's checks of the same values."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.config.loading import from_mapping, load, parse_registry
from node_agent.config.schema import RegistrySettings, Settings
from node_agent.errors import InvalidArgument
from node_agent.registry import Credentials, pull
from node_agent.store import Store


def test_defaults() -> None:
    s = Settings().registry
    assert s == RegistrySettings()
    assert (s.request_timeout, s.min_rate, s.io_timeout, s.token_realms) == (60.0, 65536.0, 30.0, ())


def test_from_a_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "registry:\n  request-timeout: 5\n  min-rate: 1048576\n  io-timeout: 2.5\n"
        "  token-realms: [auth.example, 'Auth.Example:8443', '[::1]:9000', auth.example]\n"
    )
    s = load(str(cfg)).registry
    assert s == RegistrySettings(5.0, 1048576.0, 2.5, ("auth.example:443", "auth.example:8443", "[::1]:9000"))
    assert parse_registry(s.as_mapping()) == s
    assert from_mapping({"registry": {}}).registry == RegistrySettings()


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"timeout": 5}, "unknown config key 'registry.timeout'"),
        ({"request-timeout": 0}, "positive"),
        ({"request-timeout": -1}, "positive"),
        ({"min-rate": float("inf")}, "finite"),
        ({"io-timeout": float("nan")}, "finite"),
        ({"request-timeout": True}, "number"),
        ({"min-rate": "64k"}, "number"),
        ({"token-realms": "auth.example"}, "list"),
        ({"token-realms": ["https://auth.example"]}, "registry.token-realms"),
        ({"token-realms": ["auth.example/token"]}, "registry.token-realms"),
        ({"token-realms": [""]}, "registry.token-realms"),
        ({"token-realms": [443]}, "registry.token-realms"),
        ({"token-realms": ["auth.example:0"]}, "registry.token-realms"),
    ],
)
def test_bad_values_are_refused(section: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        from_mapping({"registry": section})
    with pytest.raises(InvalidArgument, match="must be a mapping"):
        from_mapping({"registry": [section]})


@pytest.mark.parametrize(
    "settings",
    [RegistrySettings(request_timeout=0), RegistrySettings(min_rate=float("inf")), RegistrySettings(io_timeout=float("nan")),
     RegistrySettings(token_realms=("auth.example/token",))],
)
def test_the_client_checks_settings_made_in_code(tmp_path: Path, settings: RegistrySettings) -> None:
    with pytest.raises(InvalidArgument, match="registry"):
        pull(Store(tmp_path / "store"), "127.0.0.1:9/ckpt/web:v1", Credentials(plain_http=True), settings=settings)
