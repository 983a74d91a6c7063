"""Settings: every path, endpoint, timeout and policy in one frozen object.

`load()` merges built-in defaults, an optional YAML config file and command
line flags (in that order of precedence, flags last). Unknown config keys are
rejected. No I/O besides reading the config file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

from node_agent.authz import Rule, parse_rules
from node_agent.errors import InvalidArgument

DEFAULT_CONFIG_PATH = "/etc/node-agent/config.yaml"


@dataclass(frozen=True)
class Timeouts:
    """Deadlines (seconds) for every kind of awaited call."""

    cri_call: float = 30.0
    checkpoint: float = 300.0
    restore: float = 300.0
    # The longest a pod may stay frozen; the watchdog thaws it after this
    # even if the agent is alive but stuck.
    max_freeze: float = 120.0
    # Cleanup that must run (thaw, remove a half-made sandbox).
    cleanup: float = 30.0
    criu_rpc: float = 30.0
    # How long a lazily restored container may wait for StartContainer
    # before its page source gives up.
    lazy_start: float = 600.0


@dataclass(frozen=True)
class Retention:
    """Which checkpoints the store keeps; 0 means no limit."""

    max_per_pod: int = 0
    max_total_bytes: int = 0
    max_age_seconds: int = 0
    # How often the daemon collects garbage (seconds); 0 turns it off.
    gc_interval: int = 3600


_EFFECTS = ("None", "NoSchedule", "NoExecute")


@dataclass(frozen=True)
class Devices:
    """Device health and DRA device taints (docs/devices.md)."""

    enabled: bool = True
    poll_interval: float = 10.0
    # A level condition (temperature, narrow link) counts after this many
    # consecutive polls; events (Xid, rising error counters) count at once.
    raise_polls: int = 3
    # A condition is over (and its taint removed) after this long clear.
    clear_seconds: float = 60.0
    # For sensors without their own max/crit threshold, degrees Celsius.
    temperature_max: float = 90.0
    # Count a temperature this many degrees below its threshold already.
    temperature_margin: float = 0.0
    # Many GPUs lower their link speed when idle: off by default.
    check_link_speed: bool = False
    xid_ignore: tuple[int, ...] = (13, 31, 43, 45, 68, 109)
    # The Kubernetes node name (default: $NODE_NAME, else the host name).
    node_name: str = ""
    # Cluster credentials: this kubeconfig, else in-cluster, else none.
    kubeconfig: str = ""
    # Write DeviceTaintRules when there are credentials.
    taints: bool = True
    # The strongest effect a rule may escalate to, and after how long an
    # unhealthy condition escalates one step (None -> NoSchedule -> NoExecute).
    max_effect: str = "None"
    escalate_after: float = 300.0
    # API-server writes: a token bucket of this rate (per second) and burst.
    write_rate: float = 0.2
    write_burst: int = 10
    # How often ResourceSlices and the agent's own rules are listed again.
    resync_interval: float = 60.0
    api_timeout: float = 10.0


def _section_items(section: str, value: Any, cls: type) -> Iterator[tuple[dataclasses.Field[Any], str, Any]]:
    """(field, "section.key", value) for each key of a config section; unknown keys are errors."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"config key {section!r} must be a mapping")
    fields = {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}
    for key, val in value.items():
        fld = fields.get(key) if isinstance(key, str) else None
        if fld is None:
            raise InvalidArgument(f"unknown config key '{section}.{key}' (known: {', '.join(sorted(fields))})")
        yield fld, f"{section}.{key}", val


def parse_devices(value: Any) -> Devices:
    """The `devices:` section; keys are the field names with dashes."""
    changes: dict[str, Any] = {}
    for fld, name, val in _section_items("devices", value, Devices):
        if fld.type in ("bool", bool):
            if not isinstance(val, bool):
                raise InvalidArgument(f"config key {name!r}: expected true or false, got {val!r}")
            changes[fld.name] = val
        elif fld.name == "xid_ignore":
            if not isinstance(val, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in val):
                raise InvalidArgument(f"config key {name!r}: expected a list of Xid numbers, got {val!r}")
            changes[fld.name] = tuple(val)
        elif fld.name == "clear_seconds" or fld.name == "temperature_margin":
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val < 0:
                raise InvalidArgument(f"config key {name!r}: expected a finite non-negative number, got {val!r}")
            changes[fld.name] = float(val)
        elif fld.type in ("float", float):
            changes[fld.name] = _coerce(name, val, float)
        elif fld.type in ("int", int):
            changes[fld.name] = _coerce(name, val, int)
        else:
            changes[fld.name] = _coerce(name, val, str)
    d = dataclasses.replace(Devices(), **changes)
    if d.raise_polls < 1:
        raise InvalidArgument("devices.raise-polls must be at least 1")
    if d.write_burst < 1:
        raise InvalidArgument("devices.write-burst must be at least 1")
    if d.max_effect not in _EFFECTS:
        raise InvalidArgument(f"devices.max-effect must be one of {', '.join(_EFFECTS)}")
    return d


@dataclass(frozen=True)
class RegistrySettings:
    """Pushes and pulls through OCI registries: deadlines, a minimum rate, token realms (docs/registry.md)."""

    # Each request to a registry or its token server (its redirects, auth
    # retries and body included) is over within this many seconds...
    request_timeout: float = 60.0
    # ...except a blob of N bytes, which may take max(request-timeout,
    # N / min-rate): bytes per second a blob moves at, at least, on average.
    min_rate: float = 65536.0
    # Each socket operation (connect, TLS handshake, one send, one receive).
    io_timeout: float = 30.0
    # Token servers on other hosts than the registry's own that may get
    # token requests and credentials, over HTTPS only: `host` (port 443) or
    # `host:port`. Kept as `host:port`, lowercase.
    token_realms: tuple[str, ...] = ()

    def as_mapping(self) -> dict[str, Any]:
        """The `registry:` section that `parse_registry` reads back into these settings."""
        return {
            "request-timeout": self.request_timeout, "min-rate": self.min_rate,
            "io-timeout": self.io_timeout, "token-realms": list(self.token_realms),
        }


def token_realm_host(value: Any, what: str = "registry.token-realms") -> str:
    """`host`, `host:port`, `[v6]` or `[v6]:port` as `host:port` (port 443 when not given), lowercase."""
    if (not isinstance(value, str) or not value or not value.isascii()
            or any(c in "/?#@%\\" or not c.isprintable() or c.isspace() for c in value)):
        raise InvalidArgument(f"{what}: expected a host or host:port, got {value!r}")
    try:
        parts = urlsplit("https://" + value)
        port = parts.port
    except ValueError:
        raise InvalidArgument(f"{what}: expected a host or host:port, got {value!r}") from None
    host = parts.hostname
    if not host or port == 0:
        raise InvalidArgument(f"{what}: expected a host or host:port, got {value!r}")
    return f"[{host}]:{port or 443}" if ":" in host else f"{host}:{port or 443}"


def parse_registry(value: Any) -> RegistrySettings:
    """The `registry:` section; keys are the field names with dashes."""
    changes: dict[str, Any] = {}
    for fld, name, val in _section_items("registry", value, RegistrySettings):
        if fld.name == "token_realms":
            if not isinstance(val, list):
                raise InvalidArgument(f"config key {name!r}: expected a list of hosts, got {val!r}")
            changes[fld.name] = tuple(dict.fromkeys(token_realm_host(v, name) for v in val))
            continue
        number = _coerce(name, val, float)
        if not math.isfinite(number):
            raise InvalidArgument(f"config key {name!r}: must be a finite number, got {val!r}")
        changes[fld.name] = number
    return dataclasses.replace(RegistrySettings(), **changes)


@dataclass(frozen=True)
class Settings:
    cri_endpoint: str = "unix:///run/containerd/containerd.sock"
    socket: str = "/run/node-agent/agent.sock"
    store: str = "/var/lib/node-agent"
    runtime_handler: str = "criu"
    runc_root: str = "/run/containerd/runc/k8s.io"
    runc: str = "runc"
    criu: str = "criu"
    # Group (name or gid) allowed on the local socket besides root.
    socket_group: str = ""
    log_format: str = "text"
    log_level: str = "info"
    # Free bytes a restore leaves on the store's filesystem, beyond the
    # checkpoint's own size.
    min_free_bytes: int = 256 << 20
    # Where pods' log directories live, and the cgroup parent, for pods made
    # from foreign (e.g. Podman) archives.
    pod_log_root: str = "/var/log/pods"
    cgroup_parent: str = ""
    # The kubelet's root directory: a pod's own volumes live under
    # <kubelet-root>/pods/<pod uid>/, and only those host paths may a
    # checkpoint's containers mount without allow-host-access.
    kubelet_root: str = "/var/lib/kubelet"
    # Pre-dump memory while the pod runs where the kernel tracks dirty
    # memory: "auto" (default: where supported), "always" or "never".
    pre_dump: str = "auto"
    # Restore lazily (containers start at once, their memory streams in
    # from the store) where CRIU and the kernel support it: "auto" (the
    # default) or "never". A restore's own `lazy` option overrides this.
    lazy_restore: str = "auto"
    # The mutual-TLS API listener (HOST:PORT; off when empty), its PEM
    # files (re-read when they change) and who may call what there.
    listen: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    authorization: tuple[Rule, ...] = ()
    # Plaintext health (HOST:PORT or PORT, loopback by default) and
    # Prometheus metrics listeners; off when empty.
    health_listen: str = ""
    metrics_listen: str = ""
    # The CRI endpoint for the kubelet (unix:///path; off when empty).
    cri_listen: str = ""
    # The interpreter the restore wrapper runs on, as a host path. Empty: the
    # agent's own, and `serve` writes the wrapper at start. Set (the
    # DaemonSet, whose agent's Python is not on the host): `install-handler`
    # writes the wrapper and `serve` leaves it alone.
    wrapper_python: str = ""
    # The sysfs tree the device inventory reads.
    sysfs_root: str = "/sys"
    devices: Devices = field(default_factory=Devices)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retention: Retention = field(default_factory=Retention)
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    # The YAML file these settings were read from ("" if none): not a key of
    # its own, it only lets messages name the file to pass again.
    config_file: str = ""

    # Paths derived from the store; one place so the wrapper agrees.
    @property
    def journal_dir(self) -> str:
        return os.path.join(self.store, "journal")

    @property
    def work_dir(self) -> str:
        return os.path.join(self.store, "work")

    @property
    def plans_dir(self) -> str:
        return os.path.join(self.store, "plans")

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.store, "logs")

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.store, "bin")

    @property
    def wrapper_path(self) -> str:
        return os.path.join(self.bin_dir, "node-agent-runc")


_SECTIONS: dict[str, Any] = {"timeouts": Timeouts, "retention": Retention}


def _listen_value(value: Any) -> str:
    """A listener address; a bare port may be written as a number."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise InvalidArgument(f"a listener address must be HOST:PORT or a port, got {value!r}")
    return value


# Keys with their own parser: config key -> (attribute, parser).
_PARSED: dict[str, tuple[str, Any]] = {
    "authorization": ("authorization", parse_rules),
    "health-listen": ("health_listen", _listen_value),
    "metrics-listen": ("metrics_listen", _listen_value),
    "devices": ("devices", parse_devices),
    "registry": ("registry", parse_registry),
}
_NOT_KEYS = {"config_file"}
_TOP_KEYS = {
    f.name.replace("_", "-"): f.name for f in dataclasses.fields(Settings)
    if f.name not in _SECTIONS and f.name.replace("_", "-") not in _PARSED and f.name not in _NOT_KEYS
}
_LOG_FORMATS = ("text", "json")
_LOG_LEVELS = ("debug", "info", "warning", "error")


def _coerce(name: str, value: Any, want: type) -> Any:
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidArgument(f"config key {name!r}: expected a finite number, got {value!r}")
        if value <= 0:
            raise InvalidArgument(f"config key {name!r}: must be positive, got {value!r}")
        return float(value)
    if want is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"config key {name!r}: expected a non-negative integer, got {value!r}")
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"config key {name!r}: expected a string, got {value!r}")
    return value


def from_mapping(data: Mapping[str, Any], base: Settings | None = None) -> Settings:
    """Settings from a parsed config document; unknown keys are errors."""
    base = base or Settings()
    if not isinstance(data, Mapping):
        raise InvalidArgument("config file: the top level must be a mapping")
    changes: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(Settings)}
    for key, value in data.items():
        if key in _SECTIONS:
            if not isinstance(value, Mapping):
                raise InvalidArgument(f"config key {key!r} must be a mapping")
            section = _SECTIONS[key]
            known = {f.name.replace("_", "-"): f for f in dataclasses.fields(section)}
            schanges = {}
            for skey, sval in value.items():
                if skey not in known:
                    raise InvalidArgument(
                        f"unknown config key '{key}.{skey}' (known: {', '.join(sorted(known))})"
                    )
                fld = known[skey]
                num: type = float if fld.type in ("float", float) else int
                schanges[fld.name] = _coerce(f"{key}.{skey}", sval, num)
            changes[key] = dataclasses.replace(getattr(base, key), **schanges)
            continue
        if key in _PARSED:
            attr, parse = _PARSED[key]
            changes[attr] = parse(value)
            continue
        if key not in _TOP_KEYS:
            names = sorted({*_TOP_KEYS, *_SECTIONS, *_PARSED})
            raise InvalidArgument(f"unknown config key {key!r} (known: {', '.join(names)})")
        attr = _TOP_KEYS[key]
        kind: type = int if types[attr] in ("int", int) else str
        changes[attr] = _coerce(key, value, kind)
    return validate(dataclasses.replace(base, **changes))


def validate(s: Settings) -> Settings:
    for name in ("socket", "store", "runc_root", "sysfs_root", "kubelet_root", "pod_log_root"):
        if not os.path.isabs(getattr(s, name)):
            raise InvalidArgument(f"{name.replace('_', '-')} must be an absolute path, got {getattr(s, name)!r}")
    if not s.cri_endpoint.startswith(("unix://", "unix:")) and ":" not in s.cri_endpoint:
        raise InvalidArgument(f"cri-endpoint must be a unix:// URL or HOST:PORT, got {s.cri_endpoint!r}")
    if s.cri_listen and not (s.cri_listen.startswith("unix:///") and len(s.cri_listen) > len("unix:///")):
        raise InvalidArgument(f"cri-listen must be a unix:///path URL, got {s.cri_listen!r}")
    if s.wrapper_python and not os.path.isabs(s.wrapper_python):
        raise InvalidArgument(f"wrapper-python must be an absolute path, got {s.wrapper_python!r}")
    if s.log_format not in _LOG_FORMATS:
        raise InvalidArgument(f"log-format must be one of {', '.join(_LOG_FORMATS)}")
    if s.log_level not in _LOG_LEVELS:
        raise InvalidArgument(f"log-level must be one of {', '.join(_LOG_LEVELS)}")
    if s.pre_dump not in ("auto", "always", "never"):
        raise InvalidArgument("pre-dump must be auto, always or never")
    if s.lazy_restore not in ("auto", "never"):
        raise InvalidArgument("lazy-restore must be auto or never")
    if not s.runtime_handler or not all(c.isalnum() or c in "-_." for c in s.runtime_handler):
        raise InvalidArgument(f"runtime-handler {s.runtime_handler!r} is not a valid handler name")
    return _validate_listeners(s)


def host_port(value: str, *, default_host: str = "", what: str = "listen") -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT`, or `PORT`/`:PORT` with `default_host`."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    host = host.strip("[]") or default_host
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{what} must be HOST:PORT, got {value!r}")
    return host, int(port)


def _validate_listeners(s: Settings) -> Settings:
    if s.listen:
        host_port(s.listen)
        missing = [k for k in ("tls_cert", "tls_key", "tls_client_ca") if not getattr(s, k)]
        if missing:
            raise InvalidArgument(
                f"listen {s.listen} needs {', '.join(k.replace('_', '-') for k in missing)} (mutual TLS only)"
            )
    if s.health_listen:
        host_port(s.health_listen, default_host="127.0.0.1", what="health-listen")
    if s.metrics_listen:
        host_port(s.metrics_listen, default_host="127.0.0.1", what="metrics-listen")
    return s


def load(path: str | None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Defaults, then the YAML file at `path` (if given), then `overrides`.

    `overrides` uses attribute names (cri_endpoint, ...); None values are
    ignored so argparse namespaces can be passed through unchanged.
    """
    settings = Settings()
    if path:
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except OSError as exc:
            raise InvalidArgument(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise InvalidArgument(f"config file {path} is not valid YAML: {exc}") from exc
        settings = dataclasses.replace(from_mapping(data or {}, settings), config_file=os.path.abspath(path))
    if overrides:
        changes = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(changes) - {f.name for f in dataclasses.fields(Settings)}
        if unknown:
            raise InvalidArgument(f"unknown settings: {', '.join(sorted(unknown))}")
        settings = dataclasses.replace(settings, **changes)
    return validate(settings)
