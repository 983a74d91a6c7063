"""containerd's registry hosts (hosts.toml under config_path), read as containerd 1.7/2.x reads them.

Each test lays out a config_path in tmp_path; nothing here touches the network.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from node_agent.errors import InvalidArgument
from node_agent.registry.hosts import (
    CAPABILITIES,
    MAX_HOSTS_FILE,
    RegistryHost,
    check_registry_name,
    filter_hosts,
    host_directory,
    registry_hosts,
)
from testbed.layout import write_hosts_toml

ALL = frozenset({"pull", "resolve", "push", "referrers"})


def _where(hosts: list[RegistryHost]) -> list[tuple[str, str, str, bool]]:
    return [(h.scheme, h.host, h.path, h.is_mirror) for h in hosts]


# --- no configuration ---------------------------------------------------------------------------------------


def test_a_missing_config_path_leaves_the_registry_alone(tmp_path: Path) -> None:
    hosts = registry_hosts("registry.example:5000", str(tmp_path / "absent"))
    assert hosts == [
        RegistryHost("https", "registry.example:5000", "/v2", ALL, namespace="registry.example:5000")
    ]
    assert CAPABILITIES == ALL
    h = hosts[0]
    assert not h.is_mirror and not h.skip_verify and not h.http_fallback and h.dial_timeout is None
    assert h.url("/team/app/manifests/v1") == "https://registry.example:5000/v2/team/app/manifests/v1"


def test_an_empty_config_path_and_an_unrelated_directory_give_the_default(tmp_path: Path) -> None:
    write_hosts_toml(tmp_path, "other.example", 'server = "https://elsewhere.example"')
    assert _where(registry_hosts("registry.example", "")) == [("https", "registry.example", "/v2", False)]
    assert _where(registry_hosts("registry.example", str(tmp_path))) == [("https", "registry.example", "/v2", False)]
    assert host_directory("registry.example", str(tmp_path)) is None


def test_docker_io_defaults_to_registry_1(tmp_path: Path) -> None:
    (h,) = registry_hosts("docker.io", str(tmp_path))
    assert (h.scheme, h.host, h.path, h.capabilities) == ("https", "registry-1.docker.io", "/v2", ALL)
    assert not h.is_proxy  # containerd sends no ns= to Docker Hub's own server
    assert h.url("/library/busybox/manifests/latest") == (
        "https://registry-1.docker.io/v2/library/busybox/manifests/latest"
    )


# --- which directory ----------------------------------------------------------------------------------------


def test_directory_order_host_port_underscores_then_colon_then_default(tmp_path: Path) -> None:
    for name, server in (("reg.example_5000_", "one"), ("reg.example:5000", "two"), ("_default", "three")):
        write_hosts_toml(tmp_path, name, f'server = "https://{server}.example"')
    root = str(tmp_path)
    assert registry_hosts("reg.example:5000", root)[0].host == "one.example"
    assert host_directory("reg.example:5000", root) == str(tmp_path / "reg.example_5000_")
    os.remove(tmp_path / "reg.example_5000_" / "hosts.toml")
    os.rmdir(tmp_path / "reg.example_5000_")
    assert registry_hosts("reg.example:5000", root)[0].host == "two.example"
    os.remove(tmp_path / "reg.example:5000" / "hosts.toml")
    os.rmdir(tmp_path / "reg.example:5000")
    assert registry_hosts("reg.example:5000", root)[0].host == "three.example"
    # A registry without a port: its own name, then _default.
    write_hosts_toml(tmp_path, "plain.example", 'server = "https://four.example"')
    assert registry_hosts("plain.example", root)[0].host == "four.example"
    assert registry_hosts("other.example", root)[0].host == "three.example"


def test_an_existing_directory_wins_even_without_hosts_toml(tmp_path: Path) -> None:
    (tmp_path / "reg.example_5000_").mkdir()
    write_hosts_toml(tmp_path, "_default", 'server = "https://mirror.example"')
    (h,) = registry_hosts("reg.example:5000", str(tmp_path))
    assert h.host == "reg.example:5000"


def test_config_path_may_list_several_roots(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    write_hosts_toml(second, "reg.example", 'server = "https://from-b.example"')
    write_hosts_toml(second, "_default", 'server = "https://default-b.example"')
    assert registry_hosts("reg.example", f"{first}:{second}")[0].host == "from-b.example"
    write_hosts_toml(first, "_default", 'server = "https://default-a.example"')
    # The first root with any matching directory wins, _default included.
    assert registry_hosts("reg.example", f"{first}:{second}")[0].host == "default-a.example"


def test_a_file_where_a_directory_belongs_is_refused(tmp_path: Path) -> None:
    (tmp_path / "reg.example").write_text("x")
    with pytest.raises(InvalidArgument, match="not a directory"):
        registry_hosts("reg.example", str(tmp_path))


# --- hosts.toml: order, capabilities, URLs ------------------------------------------------------------------


def test_mirrors_in_file_order_then_the_server(tmp_path: Path) -> None:
    write_hosts_toml(
        tmp_path,
        "docker.io",
        """
server = "https://registry-1.docker.io"

[host."https://zeta-mirror.example"]
  capabilities = ["pull"]
[host."https://alpha-mirror.example:5000"]
  capabilities = ["pull", "resolve"]
  [host."https://alpha-mirror.example:5000".header]
    x-a = "1"
[host."http://plain-mirror.example"]
""",
    )
    hosts = registry_hosts("docker.io", str(tmp_path))
    assert _where(hosts) == [
        ("https", "zeta-mirror.example", "/v2", True),
        ("https", "alpha-mirror.example:5000", "/v2", True),
        ("http", "plain-mirror.example", "/v2", True),
        ("https", "registry-1.docker.io", "/v2", False),
    ]
    assert [h.capabilities for h in hosts] == [frozenset({"pull"}), frozenset({"pull", "resolve"}), ALL, ALL]
    assert hosts[0].url("/library/app/blobs/sha256:ab") == (
        "https://zeta-mirror.example/v2/library/app/blobs/sha256:ab?ns=docker.io"
    )
    assert hosts[2].url("/library/app/tags/list?n=10") == (
        "http://plain-mirror.example/v2/library/app/tags/list?n=10&ns=docker.io"
    )
    assert hosts[3].url("/library/app/manifests/v1") == "https://registry-1.docker.io/v2/library/app/manifests/v1"


def test_capability_filtering_keeps_order_and_never_resolves_at_a_pull_only_mirror(tmp_path: Path) -> None:
    write_hosts_toml(
        tmp_path,
        "reg.example",
        """
[host."https://public.example"]
  capabilities = ["pull"]
[host."https://private.example"]
  capabilities = ["Pull", "RESOLVE"]
[host."https://all.example"]
  capabilities = []
""",
    )
    hosts = registry_hosts("reg.example", str(tmp_path))

    def names(chosen: list[RegistryHost]) -> list[str]:
        return [h.host for h in chosen]

    assert names(filter_hosts(hosts, "pull")) == ["public.example", "private.example", "all.example", "reg.example"]
    assert names(filter_hosts(hosts, "resolve")) == ["private.example", "all.example", "reg.example"]
    assert names(filter_hosts(hosts, "pull", "push")) == ["all.example", "reg.example"]
    assert not hosts[0].can("resolve") and hosts[1].can("resolve")
    with pytest.raises(InvalidArgument, match="capability"):
        filter_hosts(hosts, "delete")


def test_root_capabilities_apply_to_a_named_server_only(tmp_path: Path) -> None:
    write_hosts_toml(tmp_path, "a.example", 'server = "https://a-server.example"\ncapabilities = ["pull"]\n')
    write_hosts_toml(tmp_path, "b.example", 'capabilities = ["pull"]\n')
    assert registry_hosts("a.example", str(tmp_path))[0].capabilities == frozenset({"pull"})
    # Without `server` the registry itself is the fallback, trusted with everything (as containerd does).
    (b,) = registry_hosts("b.example", str(tmp_path))
    assert (b.host, b.capabilities) == ("b.example", ALL)


def test_unknown_capability_is_refused(tmp_path: Path) -> None:
    path = write_hosts_toml(tmp_path, "reg.example", '[host."https://m.example"]\ncapabilities = ["pull", "delete"]\n')
    with pytest.raises(InvalidArgument) as info:
        registry_hosts("reg.example", str(tmp_path))
    assert str(path) in str(info.value) and 'host."https://m.example".capabilities' in str(info.value)


@pytest.mark.parametrize(
    ("url", "override", "want"),
    [
        ("https://m.example", False, ("https", "m.example", "/v2")),
        ("https://m.example/", False, ("https", "m.example", "/v2")),
        ("https://m.example/v2", False, ("https", "m.example", "/v2")),
        ("https://m.example/v2/", False, ("https", "m.example", "/v2")),
        ("https://m.example/prefix", False, ("https", "m.example", "/prefix/v2")),
        ("https://m.example//a/./b/../c", False, ("https", "m.example", "/a/c/v2")),
        ("https://m.example/v2/upstream", True, ("https", "m.example", "/v2/upstream")),
        ("https://m.example", True, ("https", "m.example", "")),
        ("m.example:5000", False, ("https", "m.example:5000", "/v2")),
        ("HTTP://M.example:8080", False, ("http", "M.example:8080", "/v2")),
        ("https://[fd00::1]:5000", False, ("https", "[fd00::1]:5000", "/v2")),
    ],
)
def test_the_api_root_is_completed_with_v2_unless_override_path(
    tmp_path: Path, url: str, override: bool, want: tuple[str, str, str]
) -> None:
    flag = "true" if override else "false"
    write_hosts_toml(tmp_path, "reg.example", f'[host."{url}"]\noverride_path = {flag}\n')
    mirror = registry_hosts("reg.example", str(tmp_path))[0]
    assert (mirror.scheme, mirror.host, mirror.path) == want


def test_override_path_urls(tmp_path: Path) -> None:
    write_hosts_toml(
        tmp_path,
        "reg.example",
        'server = "https://proxy.example/api/registry"\noverride_path = true\n'
        '[host."https://m.example/v2/upstream"]\noverride_path = true\n',
    )
    mirror, server = registry_hosts("reg.example", str(tmp_path))
    assert mirror.url("/app/manifests/v1") == "https://m.example/v2/upstream/app/manifests/v1?ns=reg.example"
    assert server.url("app/blobs/uploads/") == "https://proxy.example/api/registry/app/blobs/uploads/?ns=reg.example"


def test_http_hosts_are_plain_http_unless_given_tls_settings(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("x")
    write_hosts_toml(
        tmp_path,
        "reg.example",
        """
server = "http://reg.example:5000"
[host."http://plain.example:5000"]
[host."http://verify-off.example:5000"]
  skip_verify = true
[host."http://with-ca.example"]
  ca = "../ca.pem"
[host."http://port-80.example:80"]
  skip_verify = false
""",
    )
    hosts = registry_hosts("reg.example", str(tmp_path))
    got = [(h.scheme, h.host, h.http_fallback) for h in hosts]
    assert got == [
        ("http", "plain.example:5000", False),
        # containerd: an http host with TLS settings tries HTTPS first, then plain HTTP (port 80 aside).
        ("https", "verify-off.example:5000", True),
        ("https", "with-ca.example", True),
        ("http", "port-80.example:80", False),
        ("http", "reg.example:5000", False),
    ]
    assert hosts[1].skip_verify and not hosts[3].skip_verify


@pytest.mark.parametrize("registry", ["localhost:5000", "127.0.0.1:5000", "[::1]:5000", "localhost", "localhost:80"])
def test_a_loopback_registry_with_nothing_configured_is_https_and_verified(tmp_path: Path, registry: str) -> None:
    # Unlike containerd, no implicit skip-verify or plain-HTTP fallback: hosts.toml must say so.
    (h,) = registry_hosts(registry, str(tmp_path))
    assert (h.scheme, h.host, h.skip_verify, h.http_fallback) == ("https", registry, False, False)


# --- TLS files, headers, timeouts ---------------------------------------------------------------------------


def test_ca_and_client_forms_with_relative_paths(tmp_path: Path) -> None:
    d = tmp_path / "reg.example"
    write_hosts_toml(
        tmp_path,
        "reg.example",
        """
ca = "root-ca.pem"
client = "client.pem"
[host."https://one.example"]
  ca = ["a.pem", "/etc/certs/b.pem", "sub/../c.pem"]
  client = ["c1.pem", "/etc/certs/c2.pem"]
[host."https://two.example"]
  client = [["client.cert", "client.key"], ["/etc/certs/both.pem", ""]]
  skip_verify = true
""",
    )
    one, two, server = registry_hosts("reg.example", str(tmp_path))
    assert one.ca_files == (str(d / "a.pem"), "/etc/certs/b.pem", str(d / "c.pem"))
    assert one.client_certs == ((str(d / "c1.pem"), ""), ("/etc/certs/c2.pem", ""))
    assert not one.skip_verify
    assert two.ca_files == ()
    assert two.client_certs == ((str(d / "client.cert"), str(d / "client.key")), ("/etc/certs/both.pem", ""))
    assert two.skip_verify
    assert server.ca_files == (str(d / "root-ca.pem"),)
    assert server.client_certs == ((str(d / "client.pem"), ""),)
    for h in (one, two, server):
        assert all(os.path.isabs(p) for p in h.ca_files)
        assert all(os.path.isabs(c) and (k == "" or os.path.isabs(k)) for c, k in h.client_certs)


def test_headers_strings_and_lists_in_order(tmp_path: Path) -> None:
    write_hosts_toml(
        tmp_path,
        "reg.example",
        """
[header]
  x-root = "r"
[host."https://m.example"]
  [host."https://m.example".header]
    x-custom-1 = "custom header"
    x-custom-2 = ["value1", "value2"]
    x-empty = []
""",
    )
    mirror, server = registry_hosts("reg.example", str(tmp_path))
    assert mirror.headers == (("x-custom-1", "custom header"), ("x-custom-2", "value1"), ("x-custom-2", "value2"))
    assert server.headers == (("x-root", "r"),)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1.0), ("500ms", 0.5), ("1m30s", 90.0), ("1.5h", 5400.0), ("0", 0.0), ("250us", 0.00025), ("+2s", 2.0)],
)
def test_dial_timeout_is_a_go_duration(tmp_path: Path, text: str, seconds: float) -> None:
    write_hosts_toml(tmp_path, "reg.example", f'[host."https://m.example"]\ndial_timeout = "{text}"\n')
    assert registry_hosts("reg.example", str(tmp_path))[0].dial_timeout == pytest.approx(seconds)


# --- Docker's certs.d layout --------------------------------------------------------------------------------


def test_certs_d_fallback_without_hosts_toml(tmp_path: Path) -> None:
    d = tmp_path / "reg.example:5000"
    d.mkdir()
    for name in ("z-ca.crt", "a-ca.crt", "client.cert", "client.key", "lonely.cert", "notes.txt"):
        (d / name).write_text("x")
    (d / "dir.crt").mkdir()
    (h,) = registry_hosts("reg.example:5000", str(tmp_path))
    assert (h.scheme, h.host, h.path, h.capabilities, h.is_mirror) == ("https", "reg.example:5000", "/v2", ALL, False)
    assert h.ca_files == (str(d / "a-ca.crt"), str(d / "z-ca.crt"))
    assert h.client_certs == ((str(d / "client.cert"), str(d / "client.key")), (str(d / "lonely.cert"), ""))


def test_an_empty_hosts_toml_falls_back_to_certs_d(tmp_path: Path) -> None:
    path = write_hosts_toml(tmp_path, "reg.example", "")
    (path.parent / "ca.crt").write_text("x")
    (h,) = registry_hosts("reg.example", str(tmp_path))
    assert h.ca_files == (str(path.parent / "ca.crt"),)


# --- keys this agent does not use ---------------------------------------------------------------------------


def test_unknown_keys_are_ignored_and_proxy_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_hosts_toml(
        tmp_path,
        "reg.example",
        """
proxy = "http://proxy.example:3128"
future_key = 1
[host."https://m.example"]
  proxy = "http://proxy.example:3128"
  another_future_key = "x"
""",
    )
    caplog.set_level(logging.DEBUG, logger="node_agent.registry.hosts")
    registry_hosts("reg.example", str(tmp_path))
    registry_hosts("reg.example", str(tmp_path))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "proxy" in warnings[0].getMessage() and str(path) in warnings[0].getMessage()
    debug = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "future_key" in debug and "another_future_key" in debug


# --- malformed input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('server = "https://a.example"\nserver = "https://b.example"\n', "not valid TOML"),
        ("[host.\n", "not valid TOML"),
        ("server = 5\n", "key server"),
        ('server = "ftp://files.example"\n', "key server"),
        ('server = "https://user:pw@reg.example"\n', "key server"),
        ('server = "https://reg.example/?x=1"\n', "key server"),
        ('server = "https://reg example"\n', "key server"),
        ('server = "https://reg.example:99999"\n', "key server"),
        ('host = "https://m.example"\n', "key host"),
        ('[host."https://m.example"]\nca = 5\n', 'key host."https://m.example".ca'),
        ('[host."https://m.example"]\nca = ["a.pem", 5]\n', 'key host."https://m.example".ca'),
        ('[host."https://m.example"]\nca = ""\n', 'key host."https://m.example".ca'),
        ('[host."https://m.example"]\nclient = [["only-one"]]\n', 'key host."https://m.example".client'),
        ('[host."https://m.example"]\nclient = {a = 1}\n', 'key host."https://m.example".client'),
        ('[host."https://m.example"]\ncapabilities = "pull"\n', 'key host."https://m.example".capabilities'),
        ('[host."https://m.example"]\nskip_verify = "yes"\n', 'key host."https://m.example".skip_verify'),
        ('[host."https://m.example"]\noverride_path = 1\n', 'key host."https://m.example".override_path'),
        ('[host."https://m.example"]\ndial_timeout = 5\n', 'key host."https://m.example".dial_timeout'),
        ('[host."https://m.example"]\ndial_timeout = "5 seconds"\n', 'key host."https://m.example".dial_timeout'),
        ('[host."https://m.example"]\ndial_timeout = "-1s"\n', 'key host."https://m.example".dial_timeout'),
        ('[host."https://m.example"]\nheader = "x"\n', 'key host."https://m.example".header'),
        ('[host."https://m.example".header]\nx-a = 1\n', 'key host."https://m.example".header.x-a'),
        ('[host."https://m.example".header]\n"bad name" = "v"\n', 'key host."https://m.example".header'),
        ('[host."https://m.example".header]\nx-a = "v\\r\\nInjected: 1"\n', 'key host."https://m.example".header.x-a'),
        ('[host."https://m@evil.example"]\n', 'key host."https://m@evil.example"'),
        ('[host."unix:///run/registry.sock"]\n', 'key host."unix:///run/registry.sock"'),
        ('[host."https://m.example"]\nclient = ["c.pem\\u0000"]\n', 'key host."https://m.example".client'),
        ('[host.""]\n', 'key host.""'),
    ],
)
def test_malformed_hosts_toml_names_the_file_and_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write_hosts_toml(tmp_path, "reg.example", text)
    with pytest.raises(InvalidArgument) as info:
        registry_hosts("reg.example", str(tmp_path))
    assert str(path) in str(info.value) and key in str(info.value)


def test_a_hosts_toml_over_one_mebibyte_is_refused(tmp_path: Path) -> None:
    path = write_hosts_toml(tmp_path, "reg.example", "# " + "x" * MAX_HOSTS_FILE + "\n")
    with pytest.raises(InvalidArgument, match="larger than") as info:
        registry_hosts("reg.example", str(tmp_path))
    assert str(path) in str(info.value)


def test_a_hosts_toml_that_is_not_utf8_or_not_a_file_is_refused(tmp_path: Path) -> None:
    path = write_hosts_toml(tmp_path, "reg.example", "")
    path.write_bytes(b'server = "https://\xff.example"\n')
    with pytest.raises(InvalidArgument, match="UTF-8"):
        registry_hosts("reg.example", str(tmp_path))
    path.unlink()
    path.mkdir()
    with pytest.raises(InvalidArgument, match="not a regular file"):
        registry_hosts("reg.example", str(tmp_path))
    path.rmdir()
    os.mkfifo(path)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        registry_hosts("reg.example", str(tmp_path))


# --- the registry name --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "registry",
    [
        "",
        "..",
        "../outside",
        "reg.example/../../outside",
        "reg.example/sub",
        "/etc",
        "reg.example\0",
        "reg\\..\\example",
        "_default",
        ".hidden.example",
        "reg.example:port",
        "reg.example:5000:1",
        "[::1",
        "reg..example",
        "reg.example ",
        "user@reg.example",
    ],
)
def test_a_registry_name_that_is_not_host_port_is_refused(tmp_path: Path, registry: str) -> None:
    config = tmp_path / "certs.d"
    config.mkdir()
    # A hosts.toml outside config_path that an escaping name would reach.
    write_hosts_toml(tmp_path, "outside", 'server = "https://escaped.example"')
    with pytest.raises(InvalidArgument, match="host\\[:port\\]"):
        registry_hosts(registry, str(config))
    with pytest.raises(InvalidArgument):
        check_registry_name(registry)


def test_valid_registry_names(tmp_path: Path) -> None:
    for registry in ("docker.io", "reg.example:5000", "localhost", "127.0.0.1:5000", "[fd00::1]:5000", "Reg.Example"):
        check_registry_name(registry)
        assert registry_hosts(registry, str(tmp_path))[0].namespace == registry
