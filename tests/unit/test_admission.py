"""One home for the rules a checkpoint or a restore passes first (node_agent.admission).

Options are parsed once, strictly; a restore request's rules are each
evaluated once, whichever entry path asks first (a pull's admission, then
restore through a Pod), with the same answers and error texts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from node_agent import admission, errors, policy
from node_agent.admission import RestoreAdmission, RestoreOptions, parse_checkpoint_options, parse_restore_options
from node_agent.config.loading import from_mapping
from node_agent.cri import Pod
from node_agent.interop.foreign import IMPORTED_FROM
from node_agent.podformat import SavedPod, parse_all_options


def _saved(annotations: dict[str, str] | None = None, privileged: bool = False) -> SavedPod:
    config: dict[str, Any] = {"metadata": {"name": "app"}, "annotations": annotations or {}}
    if privileged:
        config["linux"] = {"security_context": {"privileged": True}}
    return SavedPod("team", "web", {"metadata": {"name": "web", "namespace": "team"}},
                    (("app", {"config": config}, {}),), ())


def _record(checkpoint_id: str = "sha256:" + "a" * 64) -> Any:
    return SimpleNamespace(id=checkpoint_id, metadata={}, key_id="")


def test_options_are_parsed_strictly_with_the_defaults_of_a_new_checkpoint() -> None:
    flags, pre_dump = parse_all_options({})
    assert parse_checkpoint_options({}) == admission.CheckpointOptions(flags, pre_dump)
    assert parse_checkpoint_options({"pre-dump": "false"}).pre_dump is False
    assert parse_restore_options({"allow-host-access": "true"}) == RestoreOptions(allow_host_access=True)
    with pytest.raises(errors.InvalidArgument, match="unknown restore option 'bogus'"):
        parse_restore_options({"bogus": "1"})
    with pytest.raises(errors.InvalidArgument):
        parse_checkpoint_options({"bogus": "1"})


def test_the_checkpoint_policy_names_the_pod() -> None:
    s = from_mapping({"namespaces": {"kube-system": {"checkpoint": False}}})
    pod = Pod("id", "dns", "kube-system", "uid", 0, "SANDBOX_READY", 0)
    with pytest.raises(errors.PermissionDenied, match="kube-system/dns"):
        admission.require_checkpoint(s, pod)
    admission.require_checkpoint(s, Pod("id", "web", "team", "uid", 0, "SANDBOX_READY", 0))


def test_each_rule_of_a_restore_is_evaluated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    real = policy.require

    def counted(*args: Any) -> None:
        asked.append(args[2])
        real(*args)

    monkeypatch.setattr(policy, "require", counted)
    rules = RestoreAdmission(from_mapping({}), "team", "team/web")
    rules.require_policy()
    record, saved = _record(), _saved()
    assert rules.admit(None, record, saved) == ""  # type: ignore[arg-type]
    assert rules.admit(None, record, saved) == ""  # type: ignore[arg-type]
    assert asked == ["team"]
    assert admission.admit(from_mapping({}), None, record, saved, "team", "team/web") == ""  # type: ignore[arg-type]
    assert asked == ["team", "team"]  # a new request asks again


def test_a_foreign_checkpoint_is_refused_with_its_engine_named() -> None:
    rules = RestoreAdmission(from_mapping({}), "team", "team/web")
    record = _record()
    with pytest.raises(errors.PermissionDenied, match=r"imported from another engine's archive \(podman\)"):
        rules.admit(None, record, _saved({IMPORTED_FROM: "podman"}))  # type: ignore[arg-type]
    assert admission.foreign_engine(record, _saved()) == ""


def test_host_access_follows_the_requests_options() -> None:
    s = from_mapping({})
    record, saved = _record(), _saved(privileged=True)
    with pytest.raises(errors.FailedPrecondition, match="container app is privileged"):
        RestoreAdmission(s, "team", "team/web").check_host_access(record, saved)
    RestoreAdmission(s, "team", "team/web", RestoreOptions(allow_host_access=True)).check_host_access(record, saved)
