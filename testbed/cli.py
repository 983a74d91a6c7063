"""The test bed's command line: up, restart, down, env (scripts/testbed runs it).

    scripts/testbed up NAME [--index N] [--handler-snippet FILE] [--containerd PATH] [--runc PATH]
                       [--images KIND,...] [--model-mib N] [--timeout S]
    scripts/testbed restart NAME [--timeout S] [--kill [--down]]
    scripts/testbed down NAME
    scripts/testbed env NAME

`up` starts a containerd of its own (root, state, sockets, runc root, CNI
bridge and subnet, network namespaces) that runs beside other beds and beside
a system containerd, imports four local images (the Debian one holds the
real workloads; the torch image only when `--images` names it) and prints the bed's description as one JSON object.
`restart` restarts its containerd as systemd would. `down` removes
everything the bed created. `env` prints the JSON of a running bed. See
docs/testbed.md.

containerd 1.6 and 1.7 get a version-2 configuration; containerd 2.x gets a
version-3 one (the CRI plugin split into io.containerd.cri.v1.runtime,
io.containerd.cri.v1.images and io.containerd.grpc.v1.cri), NRI on a socket of
the bed's own, and the runc beside its binary (install-host's prefix).

Rule: standard library only (see testbed/host.py): this runs with the system
python3 of a fresh Debian.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from testbed import host
from testbed.cleanup import clear_bed
from testbed.config import cni_config, config_version_for, containerd_config, handler_names
from testbed.host import TestbedError, alive, arg_value, kill, link_exists, log, read_argv, run, wait_gone, write_file
from testbed.images import build_images, import_images
from testbed.layout import INDEX_MAX, INDEX_MIN, IMAGES, OPTIONAL_IMAGES, STATE_ROOT, BedLayout, Lock, choose_index
from testbed.lifecycle import (
    containerd_binary,
    containerd_version,
    ctr_binary,
    runc_binary,
    runc_version,
    start_containerd,
    wait_ready,
)
from testbed.weights import MODEL_MIB_DEFAULT, MODEL_MIB_ENV, model_mib

def bed_info(bed: BedLayout, index: int, pid: int, handlers: list[str], binary: str, version: str,
             kinds: list[str], runc: str = "runc", runc_ver: str = "", config_version: int = 2,
             mib: int | None = None) -> dict[str, Any]:
    return {
        "name": bed.name,
        "index": index,
        "base": bed.base,
        "state": bed.state,
        "containerd_socket": bed.socket,
        "containerd_pid": pid,
        "containerd_binary": binary,
        "containerd_version": version,
        "containerd_log": bed.log,
        "containerd_config": bed.config,
        "config_version": config_version,
        "ctr_binary": bed.ctr_bin,
        "runc_binary": runc,
        "runc_version": runc_ver,
        "runc_root": bed.runc_root,
        "nri_socket": bed.nri_socket if config_version >= 3 else None,
        "cni_bridge": BedLayout.bridge(index),
        "subnet": BedLayout.subnet(index),
        "gateway": BedLayout.gateway(index),
        "netns_dir": bed.netns_dir,
        "pod_log_root": bed.pod_log_root,
        "kubelet_root": bed.kubelet_root,
        "cdi_dir": bed.cdi_dir,
        "registry_hosts_dir": bed.hosts_dir,
        "cgroup_parent": bed.cgroup_parent,
        "images": {kind: IMAGES[kind] for kind in kinds},
        "model_mib": mib,
        "handlers": handlers,
    }


def image_kinds(value: str | None) -> list[str]:
    """The images a bed gets: all but the optional ones (torch) by default; `pause` always
    (it is the sandbox image)."""
    if not value:
        return [k for k in IMAGES if k not in OPTIONAL_IMAGES]
    wanted = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in IMAGES]
    if unknown:
        raise TestbedError(f"unknown image {', '.join(unknown)} (known: {', '.join(IMAGES)})")
    return [k for k in IMAGES if k in wanted or k == "pause"]


def cmd_up(args: argparse.Namespace) -> int:
    bed = BedLayout(args.name)
    if args.index is not None and not INDEX_MIN <= args.index <= INDEX_MAX:
        raise TestbedError(f"--index must be in {INDEX_MIN}..{INDEX_MAX}")
    snippet = ""
    if args.handler_snippet:
        try:
            with open(args.handler_snippet) as f:
                snippet = f.read()
        except OSError as exc:
            raise TestbedError(f"cannot read {args.handler_snippet}: {exc.strerror}") from exc
    binary = containerd_binary(args.containerd)
    version = containerd_version(binary)
    config_version = config_version_for(version)
    runc, runc_named = runc_binary(args.runc, binary, version)
    runc_ver = runc_version(runc)
    ctr = ctr_binary(binary)
    config_text = containerd_config(bed, version, runc if runc_named else None)
    if snippet:
        config_text += f"\n# --- handler snippet from {args.handler_snippet}\n" + snippet
        if not config_text.endswith("\n"):
            config_text += "\n"
    handlers = handler_names(config_text, args.handler_snippet or "no snippet", config_version)

    kinds = image_kinds(args.images)
    mib = model_mib(args.model_mib)
    tarballs = build_images(kinds, mib)
    with Lock(bed.lock_path):
        previous = bed.recorded_index()
        bed.load_tools()  # what the last `up` ran, for its leftovers
        clear_bed(bed, graceful=True)
        bed.ctr_bin, bed.runc_bin = ctr, runc
        with Lock(os.path.join(STATE_ROOT, ".lock")):
            index = choose_index(bed, args.index, previous)
            os.makedirs(bed.base, exist_ok=True)
            write_file(bed.index_path, f"{index}\n")
        bridge = BedLayout.bridge(index)
        if link_exists(bridge):
            log(f"deleting stale bridge {bridge}")
            run(["ip", "link", "delete", bridge])
        dirs = [bed.root, bed.cni_conf_dir, bed.ipam_dir, bed.opt_dir, bed.pod_log_root, bed.kubelet_root,
                bed.cdi_dir, bed.hosts_dir, bed.ctr_state, bed.runc_base]
        if config_version >= 3:
            dirs += [os.path.dirname(bed.nri_socket), bed.nri_plugin_dir, bed.nri_conf_dir]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        os.chmod(bed.state, 0o711)
        write_file(os.path.join(bed.cni_conf_dir, "10-node-agent-testbed.conflist"), cni_config(bed, index))
        write_file(bed.config, config_text)

        pid = start_containerd(bed, binary)
        try:
            wait_ready(bed, pid, args.timeout)
            import_images(bed, tarballs)
        except BaseException:
            kill([pid], signal.SIGKILL)
            wait_gone([pid], 5)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            raise
        info = bed_info(bed, index, pid, handlers, binary, version, kinds, runc, runc_ver, config_version,
                        mib if "debian" in kinds else None)
        write_file(bed.json_path, json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2), flush=True)
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    """What `systemctl restart containerd` does on a node: containerd stops
    (SIGTERM; its shims, and so the pods, keep running) and starts again on
    the config as it now is, which someone may have edited (install-handler).
    With --kill it is SIGKILLed instead, as a crash ends it; --kill --down
    leaves it down (a crashed containerd nobody restarted yet), and a later
    `restart` starts it again, as systemd's Restart= does. The JSON's pid and
    handlers follow."""
    bed = BedLayout(args.name)
    with Lock(bed.lock_path):
        try:
            with open(bed.json_path) as f:
                info = json.load(f)
        except (OSError, ValueError) as exc:
            raise TestbedError(f"bed {bed.name} is not up (no {bed.json_path})") from exc
        pid = info.get("containerd_pid")
        running = isinstance(pid, int) and alive(pid) and arg_value(read_argv(pid), "--config", "-c") == bed.config
        if not running and not info.get("containerd_down"):
            raise TestbedError(f"bed {bed.name} is not running (containerd {pid} is gone); run 'testbed up {bed.name}'")
        try:
            with open(bed.config) as f:
                config_text = f.read()
        except OSError as exc:
            raise TestbedError(f"cannot read {bed.config}: {exc.strerror}") from exc
        handlers = handler_names(config_text, bed.config, info.get("config_version"))
        if running and args.kill:
            kill([pid], signal.SIGKILL)
            if wait_gone([pid], 10):
                raise TestbedError(f"containerd {pid} does not go away")
            if args.down:
                info.update(containerd_down=True)
                write_file(bed.json_path, json.dumps(info, indent=2) + "\n")
                print(json.dumps(info, indent=2), flush=True)
                return 0
        elif running:
            kill([pid], signal.SIGTERM)
        if running and not args.kill and wait_gone([pid], args.timeout):
            log(f"containerd {pid} did not stop on SIGTERM within {args.timeout:.0f}s; killing it")
            kill([pid], signal.SIGKILL)
            if wait_gone([pid], 10):
                raise TestbedError(f"containerd {pid} does not go away")
        new = start_containerd(bed, info["containerd_binary"])
        try:
            wait_ready(bed, new, args.timeout)
        except BaseException:
            kill([new], signal.SIGKILL)
            raise
        info.pop("containerd_down", None)
        info.update(containerd_pid=new, handlers=handlers)
        write_file(bed.json_path, json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2), flush=True)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    bed = BedLayout(args.name)
    with Lock(bed.lock_path) as lock:
        bed.load_tools()
        clear_bed(bed, graceful=True)
        lock.unlink()
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    bed = BedLayout(args.name)
    try:
        with open(bed.json_path) as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise TestbedError(f"bed {bed.name} is not up (no {bed.json_path})") from exc
    pid = info.get("containerd_pid")
    if not isinstance(pid, int) or not alive(pid) or arg_value(read_argv(pid), "--config", "-c") != bed.config:
        raise TestbedError(f"bed {bed.name} is not running (containerd {pid} is gone); run 'testbed up {bed.name}'")
    if not os.path.exists(bed.socket):
        raise TestbedError(f"bed {bed.name} is not running (no socket {bed.socket})")
    print(json.dumps(info, indent=2), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="testbed", description="Private containerd nodes for node-agent's tests.")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress messages on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="(re)start a bed and print its JSON")
    up.add_argument("name")
    up.add_argument("--index", type=int, help=f"bed index {INDEX_MIN}..{INDEX_MAX} (bridge natbN, subnet 10.231.N.0/24)")
    up.add_argument("--handler-snippet", metavar="FILE", help="TOML appended verbatim to the containerd config (handlers in the layout of "
                         "the bed's config: version 2 for containerd 1.x, version 3 for 2.x)")
    up.add_argument("--containerd", metavar="PATH",
                    help="containerd binary to run (default: containerd on PATH, the system's)")
    up.add_argument("--runc", metavar="PATH",
                    help="runc of the bed's runc runtime (BinaryName; default: for containerd 2.x the runc "
                         "beside its binary, else runc on PATH, the system's)")
    up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for containerd (default 60)")
    up.add_argument("--images", metavar="KIND,...",
                    help=f"import only these images (of {', '.join(IMAGES)}; pause always); "
                         f"default all but {', '.join(OPTIONAL_IMAGES)}")
    up.add_argument("--model-mib", type=int, metavar="N",
                    help=f"size of the Debian image's model weights in MiB (default ${MODEL_MIB_ENV}, "
                         f"else {MODEL_MIB_DEFAULT})")
    up.set_defaults(func=cmd_up)
    restart = sub.add_parser("restart", help="restart the bed's containerd on its config as it is now "
                             "(pods keep running) and print its JSON")
    restart.add_argument("name")
    restart.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for containerd (default 60)")
    restart.add_argument("--kill", action="store_true", help="SIGKILL containerd, as a crash ends it, then start it")
    restart.add_argument("--down", action="store_true", help="with --kill: leave it down; a later restart starts it")
    restart.set_defaults(func=cmd_restart)
    down = sub.add_parser("down", help="stop a bed and remove everything it created")
    down.add_argument("name")
    down.set_defaults(func=cmd_down)
    env = sub.add_parser("env", help="print the JSON of a running bed")
    env.add_argument("name")
    env.set_defaults(func=cmd_env)
    args = parser.parse_args(argv)
    host.VERBOSE = args.verbose
    try:
        if os.geteuid() != 0:
            raise TestbedError("must run as root")
        return int(args.func(args))
    except TestbedError as exc:
        print(f"testbed: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("testbed: error: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
