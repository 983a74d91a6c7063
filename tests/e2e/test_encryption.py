"""Encrypted, signed checkpoints on a real node: a secret held in a server's memory stays out of every store.

The agent runs with a keyring file (one key domain for two namespaces), a signing key, and
`restore.require-signature` with that key trusted for one namespace. A Python server with threads keeps a
secret string that only exists in its memory (built at run time: its command line holds only pieces). The
test checkpoints it, restores it (in full and lazily), rotates the key and re-encrypts the checkpoint, pushes
it to the registry and pulls it back; each copy answers as the same process with the same data, and once
every operation has ended the secret is found nowhere in the store, the registry's storage, or the pulled
copy. A control checkpoint in a namespace without a key shows the search would find it (and restores).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from testbed.bed import Bed, make_pod, pod_detail, reconfigured, remove_pod, wait_for
from tests.e2e.test_cross_node import _cli_with_password
from tests.e2e.test_native_import import CONTAINER, namespaced

PORT = 8080
SECRET = "na-secret-" + "5ecret-" + "value"  # what the search looks for: once in the clear, zstd keeps it
# The server builds SECRET at run time from pieces, holds 2000 copies of it and 24 MiB of random data with it
# every 64 KiB (so a clear checkpoint stores those chunks as they are, where a search finds it), and
# answers with its own account: when it started, its PID, a digest of its memory, and whether it has the secret.
SERVER = r"""
import hashlib, http.server, json, os, socketserver, threading, time
secret = ("na-secret-" + "5ecr" + "et-" + "val" + "ue") * 4
held = [secret + str(i) for i in range(2000)]
data = bytearray(os.urandom(24 << 20))
for off in range(0, len(data), 1 << 16):  # among random bytes: chunks stored as they are when not encrypted
    data[off:off + len(secret)] = secret.encode()
started = time.time()
lock = threading.Lock()
count = [0]
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        with lock:
            count[0] += 1
            body = json.dumps({"started": started, "pid": os.getpid(), "requests": count[0],
                               "memory": hashlib.sha256(data).hexdigest(),
                               "secret": hashlib.sha256(held[1999].encode()).hexdigest()}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("0.0.0.0", 8080), H).serve_forever()
"""


def _ask(ip: str) -> dict[str, Any] | None:
    conn = http.client.HTTPConnection(ip, PORT, timeout=5)
    try:
        conn.request("GET", "/", headers={"Connection": "close"})
        doc: dict[str, Any] = json.loads(conn.getresponse().read())
        return doc
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _b64key(n: int) -> str:
    return base64.b64encode(bytes([n]) * 32).decode()


def _ring(path: Path, keys: list[tuple[str, int]]) -> None:
    path.write_text(json.dumps({"domains": {"secteam": [{"id": k, "key": _b64key(n)} for k, n in keys]}}))


@pytest.fixture
def sealed(agent: Bed, tmp_path: Path) -> Iterator[tuple[Bed, Path, str]]:
    """The bed's agent restarted with encryption, a signing key and require-signature; put back afterwards."""
    ring = tmp_path / "keyring.json"
    _ring(ring, [("secteam-1", 1)])
    key = Ed25519PrivateKey.generate()
    pem = tmp_path / "signing.pem"
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    pem.chmod(0o600)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    trusted = "ed25519:" + base64.b64encode(raw).decode()
    extra = (
        f"encryption:\n  key-sources:\n    - file: {ring}\n  domains:\n    secteam: [e2e-sec, e2e-sec-copy]\n"
        f"signing:\n  key-file: {pem}\n"
        "restore:\n  require-signature: true\n"
        f"  trusted-keys:\n    e2e-sec-copy: ['{trusted}']\n"
    )
    with reconfigured(agent, extra):
        yield agent, ring, trusted


def _grep(root: Path, needle: bytes, skip: tuple[Path, ...] = ()) -> list[str]:
    found = []
    for dirpath, _dirs, files in os.walk(root):
        if any(Path(dirpath).is_relative_to(s) for s in skip):
            continue
        for name in files:
            path = Path(dirpath) / name
            try:
                if path.is_symlink() or not path.is_file():
                    continue
                if needle in path.read_bytes():
                    found.append(str(path))
            except OSError:
                continue
    return found


def _restore(bed: Bed, ckpt: str, namespace: str, *args: str, check: bool = True) -> Any:
    cp = bed.cli("restore", ckpt, "--namespace", namespace, "--start", "-o", "json", *args, check=check)
    return json.loads(cp.stdout) if cp.returncode == 0 else cp


def test_an_encrypted_signed_checkpoint_restores_and_its_secret_stays_out_of_every_store(
    sealed: tuple[Bed, Path, str], registry: Any
) -> None:
    bed, ring, trusted = sealed
    signer = "ed25519:" + hashlib.sha256(base64.b64decode(trusted.removeprefix("ed25519:"))).hexdigest()[:16]
    image = bed.info["images"]["debian"]
    store = Path(bed.store)
    pods: list[str] = []
    ckpts: list[str] = []
    try:
        # A control: the same server in a namespace without a key is checkpointed in the clear.
        clear = make_pod(bed, "e2e-clear", [namespaced("app", image, ["python3", "-c", SERVER], CONTAINER)])
        pods.append(clear.id)
        src = make_pod(bed, "e2e-sec", [namespaced("app", image, ["python3", "-c", SERVER], CONTAINER)])
        pods.append(src.id)
        ip = pod_detail(bed, src.id).ip
        before = wait_for(lambda: _ask(ip), timeout=60, what="the server to answer")
        assert before["pid"] == 1
        wait_for(lambda: _ask(pod_detail(bed, clear.id).ip), timeout=60, what="the control server")
        control = bed.cli("checkpoint", clear.id).stdout.split()[-1]
        assert _grep(store / "blobs", SECRET.encode()), "a clear checkpoint holds the secret: the search works"
        assert json.loads(bed.cli("checkpoints", "inspect", control, "-o", "json").stdout)["key_id"] == ""
        # A checkpoint in the clear still restores where keys are configured.
        old = _restore(bed, control, "e2e-sec-copy", "--name", "clear-copy")
        pods.append(old["pod_sandbox_id"])
        assert wait_for(lambda: _ask(pod_detail(bed, old["pod_sandbox_id"]).ip), timeout=60, what="the clear copy")
        remove_pod(bed, old["pod_sandbox_id"])
        bed.cli("checkpoints", "rm", control)

        ckpt = bed.cli("checkpoint", src.id).stdout.split()[-1]
        ckpts.append(ckpt)
        info = json.loads(bed.cli("checkpoints", "inspect", ckpt, "-o", "json").stdout)
        assert info["key_id"] == "secteam-1" and not info["locked"], info
        assert info["signers"] == [signer], info  # signed on publish by the node's key
        assert "secteam-1" in bed.cli("checkpoints", "ls").stdout

        # Restored in full (its sealed chunks opened and verified by the page source before the process runs),
        # under the namespace whose key is trusted: the same process, the same memory.
        res = _restore(bed, ckpt, "e2e-sec-copy", "--full")
        pods.append(res["pod_sandbox_id"])
        got = wait_for(lambda: _ask(pod_detail(bed, res["pod_sandbox_id"]).ip), timeout=60, what="the restored server")
        assert (got["started"], got["pid"], got["memory"], got["secret"]) == (
            before["started"], before["pid"], before["memory"], before["secret"]), (before, got)
        assert got["requests"] > before["requests"]

        # A namespace whose trusted keys do not include the signer: refused before anything is made.
        refused = _restore(bed, ckpt, "e2e-sec-other", check=False)
        assert refused.returncode != 0 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
        assert "ed25519:" in refused.stderr, refused.stderr
        assert not [p for p in bed.cri(lambda c: c.list_pods()) if p.namespace == "e2e-sec-other"]

        # Rotation: the newest key seals what comes next; rekey re-encrypts (and re-signs) as a new checkpoint.
        _ring(ring, [("secteam-2", 2), ("secteam-1", 1)])
        time.sleep(1.5)
        rekeyed = bed.cli("checkpoints", "rekey", ckpt, "--replace").stdout.split()[-1]
        ckpts.append(rekeyed)
        assert rekeyed != ckpt
        info = json.loads(bed.cli("checkpoints", "inspect", rekeyed, "-o", "json").stdout)
        assert info["key_id"] == "secteam-2" and info["signers"] == [signer], info  # re-signed
        assert ckpt not in bed.cli("checkpoints", "ls").stdout

        # A lazily restored replica of the re-encrypted checkpoint: its memory checksums equal.
        lazy = _restore(bed, rekeyed, "e2e-sec-copy", "--lazy", "--name", "replica")
        pods.append(lazy["pod_sandbox_id"])
        got = wait_for(lambda: _ask(pod_detail(bed, lazy["pod_sandbox_id"]).ip), timeout=60, what="the lazy replica")
        assert (got["started"], got["memory"], got["secret"]) == (before["started"], before["memory"],
                                                                  before["secret"]), (before, got)

        # Exports are plaintext: only on purpose.
        out = Path(bed.store).parent / "sec-export.tar"
        refusal = bed.cli("export", rekeyed, "--container", "app", "--file", str(out), check=False)
        assert refusal.returncode != 0 and "--plaintext" in refusal.stderr and not out.exists(), refusal.stderr

        # Through the registry and back: pushed with its signature, pulled into an empty store.
        ref = registry.ref("checkpoints/sealed:v1")
        _cli_with_password(bed, "push", rekeyed, ref, "--plain-http", "--username", "ops", password="s3cret")
        bed.cli("checkpoints", "rm", rekeyed)
        pulled = _cli_with_password(bed, "pull", ref, "--plain-http", "--username", "ops", password="s3cret")
        assert pulled.stdout.split()[-1] == rekeyed
        assert bed.cli("checkpoints", "verify", rekeyed).returncode == 0
        again = _restore(bed, rekeyed, "e2e-sec-copy", "--name", "from-registry")
        pods.append(again["pod_sandbox_id"])
        got = wait_for(lambda: _ask(pod_detail(bed, again["pod_sandbox_id"]).ip), timeout=60, what="the pulled copy")
        assert (got["started"], got["memory"]) == (before["started"], before["memory"])

        # Every operation has ended (the lazy replica's pages are in): the secret is nowhere on disk.
        wait_for(lambda: not list((store / "plans").glob("*/images")), timeout=120,
                 what="restore plans to give up their images")
        assert _grep(store, SECRET.encode()) == []
        assert _grep(registry.root, SECRET.encode()) == []
    finally:
        for pod in reversed(pods):
            remove_pod(bed, pod)
        for ckpt in ckpts:
            bed.cli("checkpoints", "rm", ckpt, check=False)
