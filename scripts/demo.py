"""The demo behind scripts/demo: checkpoint a live pod, restore it elsewhere.

It drives the same test bed as the end-to-end tests (scripts/testbed) and
the real CLI, and prints every command it runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from testbed.bed import (
    NODE_AGENT, ask, bring_up, container_detail, counter_pod, pod_detail, testbed, ticks, wait_for,
)

BED = "demo"


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def node_agent(bed, *args: str) -> str:  # type: ignore[no-untyped-def]
    print("$ node-agent " + " ".join(shlex.quote(a) for a in args), flush=True)
    env = dict(os.environ, NODE_AGENT_SOCKET=bed.socket)
    cp = subprocess.run([NODE_AGENT, *args], capture_output=True, text=True, env=env)
    sys.stdout.write(cp.stdout)
    if cp.returncode != 0:
        sys.stderr.write(cp.stderr)
        raise SystemExit(f"node-agent {args[0]} failed")
    return cp.stdout


def last_tick(path: str) -> int:
    t = ticks(path)
    return t[-1] if t else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="leave the test bed, agent and pods running")
    args = ap.parse_args()
    t0 = time.monotonic()
    work = Path("/var/lib/node-agent-demo")
    work.mkdir(parents=True, exist_ok=True)

    say("a private containerd node (scripts/testbed) with the restore handler")
    bed = bring_up(BED, work, images="busybox,memhog")
    print(f"containerd {bed.info['containerd_version']} (config version {bed.info['config_version']}), "
          f"runc {bed.info['runc_version']}: {bed.info['containerd_socket']}  pods on {bed.info['subnet']}")
    bed.start_agent()
    print(f"node-agent serve --config {bed.config}   (log: {bed.agent_log})")
    ckpt = ""
    try:
        say("a pod of two containers in namespace 'shop': a shell counter and a TCP server holding 64 MiB")
        src = counter_pod(bed, "shop", mib=64, name="cart")
        shell_log = os.path.join(src.log_dir, "shell", "0.log")
        wait_for(lambda: last_tick(shell_log) >= 10, what="the counters to run")
        src_ip = pod_detail(bed, src.id).ip
        print(f"pod shop/cart {src.id[:12]} at {src_ip}: shell tick {last_tick(shell_log)}; server says: {ask(src_ip)}")

        say("checkpoint it while it runs")
        ckpt = node_agent(bed, "checkpoint", "shop/cart").strip().splitlines()[-1]
        node_agent(bed, "checkpoints", "inspect", ckpt)

        say("restore it into namespace 'staging' and start it")
        out = node_agent(bed, "restore", ckpt, "--namespace", "staging", "--name", "cart-copy", "--start").split()
        new_pod, containers = out[0], dict(zip(out[1::2], out[2::2]))
        new_ip = pod_detail(bed, new_pod).ip
        shell_new = container_detail(bed, containers["shell"]).log_path
        wait_for(lambda: len(ticks(shell_new)) >= 3, what="the restored counter")

        say("both pods run on, each counter from where it was")
        for _ in range(3):
            time.sleep(1)
            print(f"{'shop/cart':18} shell tick {last_tick(shell_log):5}   server: {ask(src_ip)}")
            print(f"{'staging/cart-copy':18} shell tick {last_tick(shell_new):5}   server: {ask(new_ip)}"
                  f"   (resumed at tick {ticks(shell_new)[0]})")
        node_agent(bed, "checkpoints", "ls")
        say(f"done in {time.monotonic() - t0:.0f} s")
        return 0
    finally:
        if args.keep:
            print(f"\nleft running: test bed '{BED}' (scripts/testbed down {BED}), agent pid {bed.agent.pid if bed.agent else '-'}")
        else:
            if ckpt:  # the demo's checkpoint goes with its node; a run after this one lists only its own
                subprocess.run([NODE_AGENT, "checkpoints", "rm", ckpt], capture_output=True,
                               env=dict(os.environ, NODE_AGENT_SOCKET=bed.socket))
            bed.stop_agent()
            testbed("down", BED)


if __name__ == "__main__":
    sys.exit(main())
