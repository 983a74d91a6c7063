"""The config file's schema: every path, endpoint, timeout and policy in one frozen object.

The settings classes are frozen msgspec `Struct`s whose fields, written with
dashes (`raise_polls` is `raise-polls`), are the config file's keys; a
section is a nested Struct. Types and `Meta` bounds say what each key takes;
`node_agent.config.validation` reads them to check a document, and a
top-level key's `Meta` description is the help of its command line flag
(`node_agent.cli.configflags`). The few values that need more than a type (a
listener port given as a number, token realms, authorization rules) are
classes of their own. No I/O, and no checks: this module only declares.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from node_agent.authz import Rule

DEFAULT_CONFIG_PATH = "/etc/node-agent/config.yaml"
# `min-free-bytes` when the config leaves it out (and what a pull keeps free when its caller does not say).
DEFAULT_MIN_FREE_BYTES = 256 << 20

# Numbers a config key takes: every one is finite (`le` the largest float
# keeps out inf; every bound keeps out nan).
Positive = Annotated[float, Meta(gt=0, le=sys.float_info.max)]
NonNegative = Annotated[float, Meta(ge=0, le=sys.float_info.max)]
Count = Annotated[int, Meta(ge=0)]
# `chunk-size`: the store's chunking average (node_agent.store.chunking; checked equal by the tests).
CHUNK_SIZE_DEFAULT = 1 << 20
CHUNK_SIZE_MIN = 64 << 10
CHUNK_SIZE_MAX = 4 << 20
AtLeastOne = Annotated[int, Meta(ge=1)]

LogFormat = Literal["text", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
Effect = Literal["None", "NoSchedule", "NoExecute"]


class Address(str):
    """A listener address, `HOST:PORT` or a port; a bare port may be written as a number."""


class TokenRealms(tuple[str, ...]):
    """Token-server hosts, each kept once as `host:port`, lowercase (`token_realm_host`)."""


class Rules(tuple[Rule, ...]):
    """The mutual-TLS listener's authorization rules (`authz.parse_rules`)."""


class FrozenMap(dict[str, Any]):
    """A settings mapping (name -> value) that is hashable and never changes; validation builds it."""

    item_type: Any = None

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _frozen(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("settings do not change")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _frozen  # type: ignore[assignment]


class NameGroups(FrozenMap):
    """Names mapped to lists of names (`encryption.domains`, `restore.trusted-keys`)."""

    item_type = tuple[str, ...]


class _Section(Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """A config mapping: its fields with dashes are its keys, and no others."""


class Timeouts(_Section, frozen=True):
    """Deadlines (seconds) for every kind of awaited call."""

    cri_call: Positive = 30.0
    checkpoint: Positive = 300.0
    restore: Positive = 300.0
    # The longest a pod may stay frozen; the watchdog thaws it after this
    # even if the agent is alive but stuck.
    max_freeze: Positive = 120.0
    # Cleanup that must run (thaw, remove a half-made sandbox).
    cleanup: Positive = 30.0
    criu_rpc: Positive = 30.0
    # How long a lazily restored container may wait for StartContainer
    # before its page source gives up.
    lazy_start: Positive = 600.0
    # How long a lazily restored container's page source keeps trying to
    # fetch a chunk a lazy pull left in the registry (a registry that went
    # away for a moment) before the replica fails.
    lazy_fetch: Positive = 60.0
    # No longer used: a Pod restore keeps no verified files between the
    # kubelet's calls (each CreateContainer reads its container's). Accepted
    # so that configurations that set it still load.
    pod_staging: Positive = 300.0


class Retention(_Section, frozen=True):
    """Which checkpoints the store keeps; 0 means no limit."""

    max_per_pod: Count = 0
    max_total_bytes: Count = 0
    max_age_seconds: Count = 0
    # How often the daemon collects garbage (seconds); 0 turns it off.
    gc_interval: Count = 3600
    # How often restore plans of removed containers, and the restore state
    # of Pods whose sandbox is gone, are swept (seconds); 0: off.
    plan_sweep_interval: Count = 60


class Devices(_Section, frozen=True):
    """Device health and DRA device taints (docs/devices.md)."""

    enabled: bool = True
    poll_interval: Positive = 10.0
    # A level condition (temperature, narrow link) counts after this many
    # consecutive polls; events (Xid, rising error counters) count at once.
    raise_polls: AtLeastOne = 3
    # A condition is over (and its taint removed) after this long clear.
    clear_seconds: NonNegative = 60.0
    # For sensors without their own max/crit threshold, degrees Celsius.
    temperature_max: Positive = 90.0
    # Count a temperature this many degrees below its threshold already.
    temperature_margin: NonNegative = 0.0
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
    max_effect: Effect = "None"
    escalate_after: Positive = 300.0
    # API-server writes: a token bucket of this rate (per second) and burst.
    write_rate: Positive = 0.2
    write_burst: AtLeastOne = 10
    # How often ResourceSlices and the agent's own rules are listed again.
    resync_interval: Positive = 60.0
    api_timeout: Positive = 10.0


class RegistrySettings(_Section, frozen=True):
    """Pushes and pulls through OCI registries: deadlines, a minimum rate, token realms (docs/registry.md)."""

    # Each request to a registry or its token server (its redirects, auth
    # retries and body included) is over within this many seconds...
    request_timeout: Positive = 60.0
    # ...except a blob of N bytes, which may take max(request-timeout,
    # N / min-rate): bytes per second a blob moves at, at least, on average.
    min_rate: Positive = 65536.0
    # Each socket operation (connect, TLS handshake, one send, one receive).
    io_timeout: Positive = 30.0
    # Token servers on other hosts than the registry's own that may get
    # token requests and credentials, over HTTPS only: `host` (port 443) or
    # `host:port`. Kept as `host:port`, lowercase.
    token_realms: TokenRealms = TokenRealms()
    # The most bytes one pull may bring into the store (besides the
    # store's `min-free-bytes`, which every pull leaves free).
    max_pull_bytes: AtLeastOne = 64 << 30
    # Seconds a pull that stopped half-way (the registry, the network, the
    # disk) keeps the blobs it brought, so that running it again resumes;
    # garbage collection takes them afterwards. 0: until the next collection.
    partial_pull_ttl: NonNegative = 86400.0
    # Blobs one push or pull moves at once, each lane on kept-alive
    # connections of its own (1: one blob after another).
    connections: AtLeastOne = 8
    # Fetch what a lazy pull left in the registry from the moment a restore
    # of it begins (a Pod's RunPodSandbox, the API's or the CLI's restore)
    # until its page source takes over (docs/lazy-restore.md).
    prefetch: bool = True
    # containerd's registry hosts directory (its CRI `config_path`; several
    # roots separated by ':'): mirrors, CAs, client certificates and headers
    # per registry host, read as containerd reads them. Empty: none.
    config_path: str = "/etc/containerd/certs.d"
    # The node's registry logins, in docker config.json format (the
    # kubelet's own by default), matched as the kubelet matches them. Empty: none.
    credentials_file: str = "/var/lib/kubelet/config.json"

    def as_mapping(self) -> dict[str, Any]:
        """The `registry:` section that `parse_registry` reads back into these settings."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class KeySource(_Section, frozen=True):
    """One place encryption keys come from: exactly one of `file`, `secret`, `exec` (docs/security.md)."""

    # A keyring document (YAML or JSON), re-read when it changes.
    file: str = ""
    # A Kubernetes Secret mounted as a directory: its `keyring.yaml` item is
    # the keyring document, re-read when the kubelet swaps it.
    secret: str = ""
    # A KMS plugin: this command prints the keyring document as JSON on
    # stdout; run at start, every `refresh-interval` and when a key id is missing.
    exec: tuple[str, ...] = ()
    # How long the plugin may run (seconds).
    timeout: Positive = 10.0
    # Variables of the agent's environment the plugin gets besides PATH and
    # LANG (its KMS credentials, for example); exec only.
    env: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """"file", "secret" or "exec"."""
        return "file" if self.file else "secret" if self.secret else "exec"

    @property
    def where(self) -> str:
        """The path or command, for messages."""
        return self.file or self.secret or " ".join(self.exec)


class Encryption(_Section, frozen=True):
    """Encryption of checkpoint data at rest and in registries (docs/security.md)."""

    # In order of precedence: for each key domain, the first source that has
    # it supplies the key new checkpoints use; old keys are found in any.
    key_sources: tuple[KeySource, ...] = ()
    # Named groups of namespaces that share one key domain. A namespace in
    # no group is a domain of its own, named like it; "*" in a group takes
    # every namespace that no group names.
    domains: NameGroups = field(default_factory=NameGroups)
    # How often a KMS plugin is asked again (seconds).
    refresh_interval: Positive = 300.0


class Signing(_Section, frozen=True):
    """The node's checkpoint signing key (docs/security.md)."""

    # An Ed25519 private key, PEM (PKCS#8), from a file or a mounted Secret;
    # empty: checkpoints are published unsigned.
    key_file: str = ""


class PodCheckpointSettings(_Section, frozen=True):
    """PodCheckpoint objects: checkpoints asked for with kubectl (docs/podcheckpoints.md)."""

    # Watch PodCheckpoints and take those of this node's pods (needs the CRD
    # and the RBAC of deploy/, and cluster credentials as devices.kubeconfig
    # finds them: that kubeconfig, else the pod's service account).
    enabled: bool = False
    # Registries (`host[:port]`) or repositories (`host[:port]/path`) a
    # PodCheckpoint may push to, with the node's logins; empty: no push.
    push_registries: tuple[str, ...] = ()
    # How often every PodCheckpoint is listed again (time-to-live and
    # vanished nodes are also handled between lists).
    resync_interval: Positive = 60.0
    # How long a node named by a PodCheckpoint's status must have had no Node
    # object before any agent lets the deleted PodCheckpoint go.
    node_gone_grace: NonNegative = 300.0


class RestoreRules(_Section, frozen=True):
    """What a checkpoint must show before it is restored (docs/security.md)."""

    # Refuse checkpoints without a signature by a trusted key.
    require_signature: bool = False
    # Per target namespace ("*": any namespace), the public keys trusted:
    # PEM files, or `ed25519:<base64 of the 32-byte key>`.
    trusted_keys: NameGroups = field(default_factory=NameGroups)
    # Restore checkpoints imported from other engines' archives (unsigned).
    allow_foreign: bool = False
    # Restore through a Pod annotation (whoever may create Pods names the
    # checkpoint): per target namespace ("*": any), the source namespaces
    # whose checkpoints its Pods may restore besides its own.
    pod_sources: NameGroups = field(default_factory=NameGroups)
    # Registries (`host[:port]`) or repositories (`host[:port]/path`) a Pod's
    # annotation may name; empty: registry references are refused.
    pod_registries: tuple[str, ...] = ()
    # Per target namespace ("*": any), the registries or repositories
    # (entries of pod-registries) whose node logins (registry.credentials-file)
    # its Pods' restores may use; a reference elsewhere is pulled without them.
    pod_credentials: NameGroups = field(default_factory=NameGroups)
    # Namespaces whose Pods may allow host access by annotation.
    pod_host_access_namespaces: tuple[str, ...] = ()
    # When the kubelet creates a container again in a pod whose restore of
    # that container failed: "refuse" (the default; CreateContainer fails,
    # naming the failure) or "start-fresh" (it starts from its image).
    after_failed_restore: Literal["refuse", "start-fresh"] = "refuse"


class NamespaceRule(_Section, frozen=True):
    """Whether pods of a namespace may be checkpointed, and restored into it; unset: as for "*"."""

    checkpoint: bool | None = None
    restore: bool | None = None


class NamespaceRules(FrozenMap):
    """`namespaces:`: a namespace ("*": every other) -> its NamespaceRule."""

    item_type = NamespaceRule


class Document(_Section, frozen=True):
    """Every key of a config file: the settings less where they were read from."""

    # A description is the help of the key's command line flag; {default}
    # stands for the default value.
    cri_endpoint: Annotated[str, Meta(description="CRI endpoint (default {default})")] = (
        "unix:///run/containerd/containerd.sock")
    socket: Annotated[str, Meta(description="local API socket (default {default})")] = "/run/node-agent/agent.sock"
    store: Annotated[str, Meta(description="checkpoint store (default {default})")] = "/var/lib/node-agent"
    runtime_handler: Annotated[str, Meta(description="restore runtime handler (default {default})")] = "criu"
    runc_root: Annotated[str, Meta(description="runc root of CRI containers (default {default})")] = (
        "/run/containerd/runc/k8s.io")
    runc: Annotated[str, Meta(description="runc binary (default: runc on PATH)")] = "runc"
    criu: Annotated[str, Meta(description="criu binary (default: criu on PATH)")] = "criu"
    # Group (name or gid) allowed on the local socket besides root.
    socket_group: str = ""
    log_format: Annotated[LogFormat, Meta(description="daemon log format")] = "text"
    log_level: LogLevel = "info"
    # Free bytes a restore leaves on the store's filesystem, beyond the
    # checkpoint's own size, and that every pull leaves free there.
    min_free_bytes: Count = DEFAULT_MIN_FREE_BYTES
    # The average size of the content-defined chunks new checkpoints are cut
    # into, in bytes (each chunk a quarter of it to four times it; a chunk is
    # one blob, in the store and in a registry). Larger chunks move faster
    # between nodes, smaller ones store less again when a few pages change
    # between checkpoints (docs/store.md, "Chunk size").
    chunk_size: Annotated[int, Meta(ge=CHUNK_SIZE_MIN, le=CHUNK_SIZE_MAX)] = CHUNK_SIZE_DEFAULT
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
    pre_dump: Literal["auto", "always", "never"] = "auto"
    # Restore lazily (containers start at once, their memory streams in
    # from the store) where CRIU and the kernel support it: "auto" (the
    # default) or "never". A restore's own `lazy` option overrides this.
    lazy_restore: Literal["auto", "never"] = "auto"
    # The mutual-TLS API listener (HOST:PORT; off when empty), its PEM
    # files (re-read when they change) and who may call what there.
    listen: Annotated[str, Meta(description="serve the API here with mutual TLS (off by default)")] = ""
    tls_cert: Annotated[str, Meta(description="the TLS listener's PEM certificate chain (reloaded on change)")] = ""
    tls_key: Annotated[str, Meta(description="the TLS listener's PEM private key (reloaded on change)")] = ""
    tls_client_ca: Annotated[str, Meta(description="PEM CA bundle that client certificates must chain to")] = ""
    authorization: Rules = Rules()
    # Plaintext health (HOST:PORT or PORT, loopback by default) and
    # Prometheus metrics listeners; off when empty.
    health_listen: Annotated[Address, Meta(description="plaintext grpc.health.v1 (loopback by default)")] = Address("")
    metrics_listen: Annotated[Address, Meta(description="Prometheus metrics at /metrics (loopback by default)")] = (
        Address(""))
    # The CRI endpoint for the kubelet (unix:///path; off when empty).
    cri_listen: Annotated[str, Meta(description="serve the CRI for the kubelet here (unix:///path; off by default)")] = ""
    # The interpreter the restore wrapper runs on, as a host path. Empty: the
    # agent's own, and `serve` writes the wrapper at start. Set (the
    # DaemonSet, whose agent's Python is not on the host): `install-handler`
    # writes the wrapper and `serve` leaves it alone.
    wrapper_python: str = ""
    # The sysfs tree the device inventory reads.
    sysfs_root: Annotated[str, Meta(description="the sysfs tree the device inventory reads (default {default})")] = "/sys"
    devices: Devices = field(default_factory=Devices)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retention: Retention = field(default_factory=Retention)
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    encryption: Encryption = field(default_factory=Encryption)
    signing: Signing = field(default_factory=Signing)
    restore: RestoreRules = field(default_factory=RestoreRules)
    podcheckpoints: PodCheckpointSettings = field(default_factory=PodCheckpointSettings)
    # Per namespace ("*": every other), whether checkpoint and restore are
    # allowed, on every path (local socket, TLS listener, CRI, annotations).
    # Both are allowed where nothing says otherwise.
    namespaces: NamespaceRules = field(default_factory=NamespaceRules)


class Settings(Document, frozen=True):
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
    def replicas_dir(self) -> str:
        return os.path.join(self.store, "replicas")

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.store, "logs")

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.store, "bin")

    @property
    def wrapper_path(self) -> str:
        return os.path.join(self.bin_dir, "node-agent-runc")
