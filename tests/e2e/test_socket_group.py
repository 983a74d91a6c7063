"""A member of the local socket's group is not root: the daemon never opens a path it names.

The CLI streams archives through the socket, so a group member reads and writes files with its own
permissions; the path forms of Export and Import, and a registry CA given as a path, are refused to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.bed import NODE_AGENT, Bed, counter_pod, remove_pod

GID = 4343
MEMBER = ["setpriv", "--reuid=nobody", "--regid=nogroup", f"--groups={GID}"]

RAW = """
import sys, grpc
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb, nodeagent_pb2_grpc as g
sock, method, ckpt, path = sys.argv[1:5]
with grpc.insecure_channel("unix://" + sock) as ch:
    stub = g.NodeAgentStub(ch)
    try:
        if method == "Export":
            stub.Export(pb.ExportRequest(checkpoint_id=ckpt, container="shell", output_path=path), timeout=60)
        elif method == "Import":
            stub.Import(pb.ImportRequest(input_path=path), timeout=60)
        else:
            creds = pb.RegistryCredentials(ca_file=path, plain_http=True)
            list(stub.Pull(pb.PullRequest(reference="127.0.0.1:1/x/y:1", credentials=creds), timeout=60))
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
"""


@pytest.fixture
def grouped(agent: Bed) -> Iterator[tuple[Bed, Path]]:
    """The bed's agent with `socket-group`, its socket in a directory others may traverse."""
    open_dir = Path(tempfile.mkdtemp(prefix="na-group-"))
    open_dir.chmod(0o755)
    config = Path(agent.config)
    original, socket = config.read_text(), agent.socket
    agent.stop_agent()
    agent.socket = str(open_dir / "agent.sock")
    config.write_text(original.replace(f"socket: {socket}\n", f"socket: {agent.socket}\n")
                      + f"socket-group: '{GID}'\n")
    agent.start_agent()
    try:
        yield agent, open_dir
    finally:
        agent.stop_agent()
        config.write_text(original)
        agent.socket = socket
        agent.start_agent()
        shutil.rmtree(open_dir, ignore_errors=True)


def as_member(bed: Bed, *args: str, cwd: str = "/") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NODE_AGENT_SOCKET=bed.socket, HOME="/nonexistent")
    return subprocess.run([*MEMBER, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_a_group_member_cannot_have_the_agent_open_paths(grouped: tuple[Bed, Path]) -> None:
    bed, open_dir = grouped
    pod = counter_pod(bed, "e2e-group", flip=False)
    try:
        ckpt = bed.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        root_only = open_dir / "root-only"
        root_only.mkdir(mode=0o700)
        (root_only / "secret").write_text("root's\n")

        # The CLI streams: the write into a root-only directory is the member's own, and fails.
        cp = as_member(bed, NODE_AGENT, "export", ckpt, "--container", "shell", "--file", str(root_only / "x.tar"))
        assert cp.returncode != 0 and "Permission denied" in cp.stderr, cp.stderr
        cp = as_member(bed, NODE_AGENT, "import", str(root_only / "secret"))
        assert cp.returncode != 0 and "Permission denied" in cp.stderr, cp.stderr
        # The path forms, called directly, are refused to a member.
        for method, path in (("Export", root_only / "y.tar"), ("Import", root_only / "secret"),
                             ("Pull", root_only / "secret")):
            cp = as_member(bed, sys.executable, "-c", RAW, bed.socket, method, ckpt, str(path), cwd=str(Path.cwd()))
            assert cp.stdout.startswith("PERMISSION_DENIED") and "socket group" in cp.stdout, (method, cp.stdout,
                                                                                                cp.stderr)
        assert sorted(os.listdir(root_only)) == ["secret"]

        # Streamed into the member's own directory: written by the member, then imported back.
        mine = open_dir / "mine"
        mine.mkdir()
        shutil.chown(mine, "nobody")
        out = mine / "shell.tar.zst"
        cp = as_member(bed, NODE_AGENT, "export", ckpt, "--container", "shell", "--file", str(out))
        assert cp.returncode == 0, cp.stderr
        st = out.stat()
        assert st.st_uid != 0 and st.st_mode & 0o777 == 0o600 and st.st_size > 0
        cp = as_member(bed, NODE_AGENT, "import", str(out), "--namespace", "e2e-group-imp")
        assert cp.returncode == 0 and cp.stdout.strip().startswith("sha256:"), cp.stderr
        bed.cli("checkpoints", "rm", cp.stdout.strip(), check=False)
        # Root keeps the path forms.
        cp = subprocess.run([sys.executable, "-c", RAW, bed.socket, "Export", ckpt, str(root_only / "z.tar")],
                            capture_output=True, text=True, timeout=300)
        assert cp.stdout.strip() == "OK" and (root_only / "z.tar").stat().st_size > 0, cp.stdout + cp.stderr
        bed.cli("checkpoints", "rm", ckpt, check=False)
    finally:
        remove_pod(bed, pod.id)
