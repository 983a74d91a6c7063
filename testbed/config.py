"""A bed's containerd config (version 2 for containerd 1.6/1.7, version 3 for 2.x) and its CNI config.

Where containerd keeps what (plugin names, the runtime handlers' tables,
the sandboxer) comes from node_agent/containerd.py; this module only says
what a bed sets there. The runtime handlers of a config, and a handler
snippet in the other version's layout refused.

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import json
import os
import re
import tomllib

from node_agent.containerd import (
    CRI,
    CRI_IMAGES,
    CRI_RUNTIME,
    RUNTIME_PLUGIN,
    SANDBOXER,
    all_runtimes,
    containerd_table,
    plugin_table,
    runtimes,
    table,
)
from testbed.host import TestbedError
from testbed.layout import CNI_BIN_DIR, IMAGES, BedLayout

def toml_str(value: str) -> str:
    return json.dumps(value)


def version_tuple(version: str) -> tuple[int, ...]:
    """(2, 1, 9) for `2.1.9+unknown`, (1, 6, 20) for `1.6.20~ds1`, () if unparsable."""
    m = re.match(r"v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def config_version_for(containerd_version: str) -> int:
    """The configuration version a containerd gets: 3 for 2.x, else 2."""
    return 3 if version_tuple(containerd_version)[:1] >= (2,) else 2


def containerd_config(bed: BedLayout, containerd_version: str = "1.6", runc_binary: str | None = None) -> str:
    """The bed's configuration: version 3 for containerd 2.x, else version 2.
    `runc_binary` becomes the `runc` runtime's BinaryName (None: runc on PATH)."""
    if config_version_for(containerd_version) >= 3:
        return containerd_config_v3(bed, containerd_version, runc_binary)
    return containerd_config_v2(bed, runc_binary)


def _binary_name(runc_binary: str | None, indent: str) -> str:
    return f"{indent}BinaryName = {toml_str(runc_binary)}\n" if runc_binary else ""


def _shared_sections(bed: BedLayout) -> str:
    """The sections versions 2 and 3 write alike: the sockets, debug and metrics
    off, and the opt plugin's dir; `[plugins]` is left open for the rest."""
    q = toml_str
    return f"""\
[grpc]
  address = {q(bed.socket)}

[ttrpc]
  address = {q(bed.ttrpc_socket)}

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = {q(bed.opt_dir)}
"""


def containerd_config_v2(bed: BedLayout, runc_binary: str | None = None) -> str:
    q = toml_str
    cri = f"[{plugin_table(CRI)}"
    ctd = f"[{containerd_table(2)}"
    runc = f"[{table(2, 'runc')}"
    return f"""\
# containerd configuration of node-agent test bed {bed.name} (written by scripts/testbed).
version = 2
root = {q(bed.root)}
state = {q(bed.ctr_state)}
# Snapshotters that cannot work here, and NRI (a host-wide socket, containerd 1.7).
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.nri.v1.nri",
]

{_shared_sections(bed)}
  # Unused, but the tasks service cannot start without it; keep its runc root
  # out of the host-wide /run/containerd/runc.
  [plugins."io.containerd.runtime.v1.linux"]
    runtime_root = {q(os.path.join(bed.state, "runc-v1"))}

  {cri}]
    sandbox_image = {q(IMAGES["pause"])}
    # Lowering oom_score_adj needs CAP_SYS_RESOURCE; without this every sandbox fails.
    restrict_oom_score_adj = true
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    # Network namespaces under this bed's state dir instead of the shared /var/run/netns.
    netns_mounts_under_state_dir = true
    # CDI devices resolve from this bed's own spec dir only.
    enable_cdi = true
    cdi_spec_dirs = [{q(bed.cdi_dir)}]

    {cri}.registry]
      config_path = {q(bed.hosts_dir)}

    {cri}.cni]
      bin_dir = {q(CNI_BIN_DIR)}
      conf_dir = {q(bed.cni_conf_dir)}
      max_conf_num = 1

    {ctd}]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"

      {runc}]
        runtime_type = "io.containerd.runc.v2"

        {runc}.options]
{_binary_name(runc_binary, "          ")}\
          # The shim appends the namespace: CRI containers live in {bed.runc_root}.
          Root = {q(bed.runc_base)}
          SystemdCgroup = false
"""


def containerd_config_v3(bed: BedLayout, containerd_version: str, runc_binary: str | None) -> str:
    """Version 3 (containerd 2.x): the same settings as version 2, with the CRI
    plugin split into its runtime, images and server parts, and NRI on."""
    q = toml_str
    rt = f"[{plugin_table(CRI_RUNTIME)}"
    img = f"[{plugin_table(CRI_IMAGES)}"
    ctd = f"[{containerd_table(3)}"
    runc = f"[{table(3, 'runc')}"
    # `bin_dir` is deprecated from 2.1 on, `bin_dirs` unknown before.
    if version_tuple(containerd_version)[:2] >= (2, 1):
        cni_bin = f"bin_dirs = [{q(CNI_BIN_DIR)}]"
    else:
        cni_bin = f"bin_dir = {q(CNI_BIN_DIR)}"
    return f"""\
# containerd configuration of node-agent test bed {bed.name} (written by scripts/testbed).
version = 3
root = {q(bed.root)}
state = {q(bed.ctr_state)}
# Snapshotters (and erofs' differ) that cannot work here.
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
  "io.containerd.differ.v1.erofs",
]

{_shared_sections(bed)}
  # NRI is on, as in containerd 2.x by default, but on this bed's own socket and
  # plugin dirs instead of the host-wide /var/run/nri/nri.sock and /opt/nri.
  [plugins."io.containerd.nri.v1.nri"]
    disable = false
    socket_path = {q(bed.nri_socket)}
    plugin_path = {q(bed.nri_plugin_dir)}
    plugin_config_path = {q(bed.nri_conf_dir)}

  # The CRI server: only the streaming settings are left here.
  [{plugin_table(CRI)}]
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"

  {img}]
    snapshotter = "overlayfs"

    {img}.pinned_images]
      sandbox = {q(IMAGES["pause"])}

    {img}.registry]
      config_path = {q(bed.hosts_dir)}

  {rt}]
    # Lowering oom_score_adj needs CAP_SYS_RESOURCE; without this every sandbox fails.
    restrict_oom_score_adj = true
    # Network namespaces under this bed's state dir instead of the shared /var/run/netns.
    netns_mounts_under_state_dir = true
    # CDI devices resolve from this bed's own spec dir only.
    enable_cdi = true
    cdi_spec_dirs = [{q(bed.cdi_dir)}]

    {rt}.cni]
      {cni_bin}
      conf_dir = {q(bed.cni_conf_dir)}
      max_conf_num = 1

    {ctd}]
      default_runtime_name = "runc"

      {runc}]
        runtime_type = "io.containerd.runc.v2"
        sandboxer = "{SANDBOXER}"

        {runc}.options]
{_binary_name(runc_binary, "          ")}\
          # The shim appends the namespace: CRI containers live in {bed.runc_root}.
          Root = {q(bed.runc_base)}
          SystemdCgroup = false
"""


def cni_config(bed: BedLayout, index: int) -> str:
    conf = {
        "cniVersion": "1.0.0",
        "name": bed.cni_network,
        "plugins": [{
            "type": "bridge",
            "bridge": BedLayout.bridge(index),
            "isGateway": True,
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "dataDir": bed.ipam_dir,
                "ranges": [[{"subnet": BedLayout.subnet(index), "gateway": BedLayout.gateway(index)}]],
                "routes": [{"dst": "0.0.0.0/0"}],
            },
        }],
    }
    return json.dumps(conf, indent=2) + "\n"


def handler_names(config_text: str, source: str, config_version: int | None = None) -> list[str]:
    """The runtime handlers in a configuration. With `config_version`, handlers
    in the other version's layout are an error: containerd 2.x ignores
    version-2 tables in a version-3 file with only a warning (and 1.x does the
    same with version-3 ones)."""
    try:
        config = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError as exc:
        raise TestbedError(f"containerd config with {source} is not valid TOML: {exc}") from exc
    if config_version is not None:
        mine, other = (3, 2) if config_version >= 3 else (2, 3)
        stray = list(runtimes(config, other))
        if stray:
            raise TestbedError(
                f"{source}: handler(s) {', '.join(stray)} are under {plugin_table(RUNTIME_PLUGIN[other])}, which "
                f"this bed's version-{config_version} config ignores; put them under {table(mine, 'NAME')}"
                + (f' (with sandboxer = "{SANDBOXER}")' if config_version >= 3 else ""))
    return list(all_runtimes(config))
