"""A checkpoint signed by the agent travels through a real registry with its signature."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent import signing
from node_agent.config.loading import from_mapping
from node_agent.errors import PermissionDenied
from node_agent.registry import Credentials, pull
from node_agent.store import Store
from testbed.bed import NODE_AGENT, Bed, container_detail, counter_pod, remove_pod, ticks, wait_for


def _trusting(key: Ed25519PrivateKey) -> Any:
    inline = "ed25519:" + base64.b64encode(signing.raw_public(key.public_key())).decode()
    return from_mapping({"restore": {"require-signature": True, "trusted-keys": {"*": [inline]}}})


def test_a_signed_checkpoint_is_pushed_and_pulled_with_its_signature(agent: Bed, registry: Any, tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    key_file = tmp_path / "signing.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    config = Path(agent.config)
    original = config.read_text()
    config.write_text(original + f"signing:\n  key-file: {key_file}\n")
    agent.stop_agent()
    agent.start_agent()
    try:
        pod = counter_pod(agent, "e2e-signed", mib=8)
        try:
            server = container_detail(agent, pod.containers["server"])
            wait_for(lambda: len(ticks(server.log_path)) >= 2, what="ticks")
            ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
            node = Store(agent.store)
            (sig, _), = node.referrers(ckpt)
            listed = [c["id"] for c in json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout)]
            assert ckpt in listed and sig not in listed

            ref = registry.ref("checkpoints/signed:v1")
            cp = subprocess.run(
                [NODE_AGENT, "push", ckpt, ref, "--plain-http", "--username", "ops", "--password-stdin"],
                input="s3cret\n", capture_output=True, text=True, timeout=300, env=dict(os.environ, NODE_AGENT_SOCKET=agent.socket),
            )
            assert cp.returncode == 0, cp.stderr

            fresh = Store(tmp_path / "fresh")
            pull(fresh, ref, Credentials("ops", "s3cret", plain_http=True))
            assert [d for d, _ in fresh.referrers(ckpt)] == [sig]
            record = fresh.get(ckpt)
            kid = signing.key_id(key.public_key())
            assert signing.require_trusted(fresh, record, _trusting(key), "e2e-restored") == kid
            with pytest.raises(PermissionDenied, match=f"signed by {kid}, which is not trusted"):
                signing.require_trusted(fresh, record, _trusting(Ed25519PrivateKey.generate()), "e2e-restored")

            agent.cli("checkpoints", "rm", ckpt)
            assert node.referrers(ckpt) == [] and not node.has_blob(sig)
        finally:
            remove_pod(agent, pod.id)
    finally:
        config.write_text(original)
        agent.stop_agent()
        agent.start_agent()


@pytest.mark.also17
def test_rekey_never_signs_what_no_trusted_key_signed(agent: Bed, tmp_path: Path) -> None:
    """A checkpoint made while the node had no signing key stays unsigned through `rekey`, and is refused
    where signatures are required; one the node signed is signed again."""
    from testbed.bed import reconfigured
    from tests.e2e.test_encryption import _ring

    src = counter_pod(agent, "e2e-rekey", flip=False)
    made: list[str] = []
    try:
        unsigned = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        made.append(unsigned)
        key = Ed25519PrivateKey.generate()
        key_file = tmp_path / "signing.pem"
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_file.chmod(0o600)
        trusted = "ed25519:" + base64.b64encode(signing.raw_public(key.public_key())).decode()
        ring = tmp_path / "keyring.json"
        _ring(ring, [("rekey-1", 3)])
        extra = (f"encryption:\n  key-sources:\n    - file: {ring}\n  domains:\n    secteam: [e2e-rekey]\n"
                 f"signing:\n  key-file: {key_file}\n"
                 f"restore:\n  require-signature: true\n  trusted-keys:\n    '*': ['{trusted}']\n")
        with reconfigured(agent, extra):
            refused = agent.cli("restore", unsigned, "--start", check=False)
            assert refused.returncode != 0 and "no signature" in refused.stderr, refused.stderr
            out = json.loads(agent.cli("checkpoints", "rekey", unsigned, "-o", "json").stdout)
            copy = out["checkpoint_id"]
            assert not out.get("signed_by") and "signature" in out.get("unsigned_reason", ""), out
            made.append(copy)
            assert copy != unsigned
            info = json.loads(agent.cli("checkpoints", "inspect", copy, "-o", "json").stdout)
            assert info["key_id"] == "rekey-1" and info.get("signers", []) == [], info
            # Laundering would make this restore pass: the copy is refused like its source.
            refused = agent.cli("restore", copy, "--start", check=False)
            assert refused.returncode != 0 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
            assert "no signature" in refused.stderr, refused.stderr

            # What the node signed itself is signed again.
            signed = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
            made.append(signed)
            _ring(ring, [("rekey-2", 4), ("rekey-1", 3)])

            def rekeyed() -> str | None:
                new = str(json.loads(agent.cli("checkpoints", "rekey", signed, "-o", "json").stdout)["checkpoint_id"])
                return new if new != signed else None  # the same id until the new key file is read

            again = wait_for(rekeyed, timeout=10, what="the new key to be read", interval=0.5)
            made.append(again)
            info = json.loads(agent.cli("checkpoints", "inspect", again, "-o", "json").stdout)
            assert info["key_id"] == "rekey-2" and len(info["signers"]) == 1, info
    finally:
        remove_pod(agent, src.id)
        for ckpt in made:
            agent.cli("checkpoints", "rm", ckpt, check=False)
