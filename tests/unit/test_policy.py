"""The per-namespace checkpoint and restore policy (node_agent.policy) and how doctor prints it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node_agent import errors, policy
from node_agent.cli import doctor, main
from node_agent.cli.checks import Check
from node_agent.config.loading import from_mapping
from node_agent.config.schema import Settings
from node_agent.errors import InvalidArgument


def settings(namespaces: dict[str, Any] | None = None, **more: Any) -> Settings:
    return from_mapping({**({"namespaces": namespaces} if namespaces is not None else {}), **more})


def test_without_rules_everything_is_allowed() -> None:
    s = Settings()
    for action in policy.ACTIONS:
        assert policy.allowed(s, action, "kube-system")
        assert policy.decide(s, action, "kube-system") == policy.Decision(True)
    policy.require(s, "restore", "kube-system", "kube-system/web")


def test_a_namespace_rule_wins_and_unset_fields_fall_back_to_the_default() -> None:
    s = settings({"*": {"restore": False}, "kube-system": {"checkpoint": False}, "staging": {"restore": True}})
    assert not policy.allowed(s, "checkpoint", "kube-system")
    assert not policy.allowed(s, "restore", "kube-system")  # unset there: "*" says no
    assert policy.decide(s, "restore", "kube-system") == policy.Decision(False, 'namespaces["*"].restore', True)
    assert policy.allowed(s, "checkpoint", "staging") and policy.allowed(s, "restore", "staging")
    assert policy.decide(s, "checkpoint", "staging") == policy.Decision(True)  # nobody sets it: allowed
    assert policy.allowed(s, "checkpoint", "prod") and not policy.allowed(s, "restore", "prod")
    # An explicit true beats a refusing default.
    s = settings({"*": {"checkpoint": False, "restore": False}, "prod": {"checkpoint": True, "restore": True}})
    assert policy.decide(s, "checkpoint", "prod") == policy.Decision(True, 'namespaces["prod"].checkpoint')
    assert not policy.allowed(s, "checkpoint", "other")


def test_the_refusal_names_the_action_the_pod_and_the_key() -> None:
    s = settings({"kube-system": {"restore": False}, "*": {"checkpoint": False}})
    with pytest.raises(errors.PermissionDenied) as e:
        policy.require(s, "restore", "kube-system", "kube-system/dns-restored-abc123")
    assert str(e.value) == ('restore as pod kube-system/dns-restored-abc123: refused by this node\'s policy: '
                            'namespaces["kube-system"].restore is false')
    with pytest.raises(errors.PermissionDenied) as e:
        policy.require(s, "checkpoint", "kube-system", "kube-system/dns")
    assert str(e.value) == ('checkpoint of pod kube-system/dns: refused by this node\'s policy: '
                            'namespaces["*"].checkpoint is false and namespaces["kube-system"] does not set checkpoint')
    assert e.value.code == "PERMISSION_DENIED"


def test_unknown_actions_and_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError):
        policy.decide(Settings(), "remove", "x")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="namespaces"):
        settings({"prod": {"checkpoint": "no"}})
    with pytest.raises(InvalidArgument, match="namespaces"):
        settings({"prod": {"push": False}})
    with pytest.raises(InvalidArgument, match="namespaces"):
        settings({"prod": True})


FULL: dict[str, Any] = {
    "namespaces": {"*": {"restore": False}, "kube-system": {"checkpoint": False}, "staging": {"restore": True}},
    "restore": {"require-signature": True, "allow-foreign": False,
                "trusted-keys": {"*": ["/etc/node-agent/ci.pub.pem"], "prod": ["ed25519:" + "A" * 43 + "="]},
                "pod-sources": {"prod": ["staging"]}, "pod-registries": ["registry.example:5000/ckpt"],
                "pod-credentials": {"prod": ["registry.example:5000/ckpt"]},
                "pod-host-access-namespaces": ["gpu-ops"]},
    "signing": {"key-file": "/etc/node-agent/signing.pem"},
    "encryption": {"key-sources": [{"file": "/etc/node-agent/keyring.yaml"},
                                   {"exec": ["/usr/bin/kms-plugin", "--token", "s3cr3t-token"]}],
                   "domains": {"team-a": ["a1", "a2"]}},
}


def test_the_description_lists_every_rule_and_no_secret() -> None:
    lines = policy.describe(from_mapping(FULL))
    assert lines == [
        'namespaces["*"] (every namespace without its own rule): checkpoint allowed (nothing set), restore refused',
        'namespaces["kube-system"]: checkpoint refused, restore refused (as "*")',
        'namespaces["staging"]: checkpoint allowed (nothing set), restore allowed',
        "restore.require-signature: true",
        'restore.trusted-keys["*"]: /etc/node-agent/ci.pub.pem',
        'restore.trusted-keys["prod"]: ed25519:' + "A" * 43 + "=",
        "restore.pod-sources (restore-from across namespaces): into prod: from staging",
        "restore.pod-registries: registry.example:5000/ckpt",
        "restore.pod-credentials (the node's registry logins for restore-from): in prod: registry.example:5000/ckpt",
        "restore.pod-host-access-namespaces: gpu-ops",
        "restore.allow-foreign: false (checkpoints imported from CRI-O, Podman or containerd archives are not restored)",
        "signing.key-file: /etc/node-agent/signing.pem (new checkpoints are signed)",
        "encryption.key-sources: file /etc/node-agent/keyring.yaml; exec /usr/bin/kms-plugin (2 argument(s))",
        "encryption.domains: team-a: a1, a2",
    ]
    assert not any("s3cr3t" in line for line in lines)
    plain = policy.describe(Settings())
    assert plain[0] == ('namespaces["*"] (every namespace without its own rule): checkpoint allowed (nothing set), '
                        'restore allowed (nothing set)')
    assert plain[3] == "restore.pod-sources (restore-from across namespaces): none (a Pod restores only " \
        "checkpoints of its own namespace)"
    assert plain[4] == "restore.pod-registries: none (registry references in restore-from are refused)"
    assert plain[5] == ("restore.pod-credentials (the node's registry logins for restore-from): none (Pods pull "
                        "without the node's logins)")
    assert plain[6] == "restore.pod-host-access-namespaces: none"
    assert "restore.allow-foreign: false" in plain[7] and plain[8].startswith("signing.key-file: none")
    assert "restore.allow-foreign: true" in policy.describe(settings(restore={"allow-foreign": True}))


def test_doctor_warns_when_signatures_are_required_but_no_key_is_trusted() -> None:
    c = doctor._policy_check(settings(restore={"require-signature": True}))
    assert c.verdict == "WARN" and "every restore is refused" in c.detail and "restore.trusted-keys" in c.fix
    c = doctor._policy_check(from_mapping(FULL))
    assert c.line() == 'OK   policy: 2 namespace rule(s) besides "*"; restores need a trusted signature (below)'


def test_doctor_deployment_prints_the_effective_policy_from_its_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**FULL, "store": str(tmp_path / "store")}))
    monkeypatch.setattr(doctor, "run_checks", lambda s: [Check("cri", "OK", "stubbed")])
    monkeypatch.setattr(doctor, "deployment_checks", lambda s, base, **kw: [*base, doctor._policy_check(s)])
    assert main.main(["doctor", "--deployment", "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["OK   cri: stubbed",
                       'OK   policy: 2 namespace rule(s) besides "*"; restores need a trusted signature (below)']
    assert out[2] == f"policy, from {config}:"
    assert out[3:] == ["  " + line for line in policy.describe(from_mapping(FULL))]
    # Without --deployment: the checks only.
    assert main.main(["doctor", "--config", str(config)]) == 0
    assert capsys.readouterr().out.splitlines() == ["OK   cri: stubbed"]


def test_a_pod_restores_from_its_own_namespace_and_those_pod_sources_lets_in() -> None:
    s = settings(restore={"pod-sources": {"prod": ["staging", "canary"], "*": ["shared"]}})
    assert policy.pod_may_restore_from(s, "prod", "prod")
    assert policy.pod_may_restore_from(s, "staging", "prod") and policy.pod_may_restore_from(s, "canary", "prod")
    assert policy.pod_may_restore_from(s, "shared", "team-x")  # "*": into every namespace
    assert not policy.pod_may_restore_from(s, "tenant-b", "prod")
    assert not policy.pod_may_restore_from(s, "staging", "team-x")
    assert not policy.pod_may_restore_from(Settings(), "tenant-b", "tenant-a")
    anything = settings(restore={"pod-sources": {"ops": ["*"]}})
    assert policy.pod_may_restore_from(anything, "tenant-b", "ops") and not policy.pod_may_restore_from(
        anything, "ops", "tenant-b")


def test_host_access_by_annotation_only_where_the_node_says() -> None:
    with pytest.raises(errors.PermissionDenied) as e:
        policy.require_pod_host_access(Settings(), "tenant-a", "tenant-a/p")
    assert str(e.value) == ("restore as pod tenant-a/p: the Pod's annotation allows host access, which this node "
                            "honours only in namespaces listed in restore.pod-host-access-namespaces (none)")
    s = settings(restore={"pod-host-access-namespaces": ["gpu-ops"]})
    policy.require_pod_host_access(s, "gpu-ops", "gpu-ops/p")
    with pytest.raises(errors.PermissionDenied, match=r"\(gpu-ops\)$"):
        policy.require_pod_host_access(s, "tenant-a", "tenant-a/p")
    policy.require_pod_host_access(settings(restore={"pod-host-access-namespaces": ["*"]}), "any", "any/p")
