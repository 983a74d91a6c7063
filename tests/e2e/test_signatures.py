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
from node_agent.config import from_mapping
from node_agent.errors import PermissionDenied
from node_agent.registry import Credentials, pull
from node_agent.store import Store
from tests.e2e.bed import NODE_AGENT, Bed, container_detail, counter_pod, remove_pod, ticks, wait_for


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
