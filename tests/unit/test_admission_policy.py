"""deploy/restore-admission.yaml: the admission policy's CEL, run against allowed and refused requests.

The expressions are read from the manifest and evaluated with cel-python.
What the Kubernetes CEL environment has and cel-python lacks is stood in for
here, as Kubernetes defines it and no further: the `authorizer` object
(group, resource, subresource, namespace, name, check, and the decision's
allowed, reason, errored, error), answering from an RBAC-like table; and the
admission steps around the expressions (resource rules, matchConditions,
variables, validations, messages, failurePolicy Fail). An expression that
does not parse, or that calls a function neither cel-python's standard CEL
nor the stand-in provides, fails the suite: a Kubernetes-only extension
(`lowerAscii`, `split`, ...) has to be added to the stand-in, faithfully,
before the policy may use it.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # its date libraries, on newer Pythons
    import celpy
    import celpy.celtypes as ct
    from celpy.evaluation import base_functions

from node_agent.api.cri_endpoint import ALLOW_HOST_ACCESS, RESTORE_FROM

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "restore-admission.yaml"
DOCS = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
(POLICY,) = [d for d in DOCS if d["kind"] == "ValidatingAdmissionPolicy"]
(BINDING,) = [d for d in DOCS if d["kind"] == "ValidatingAdmissionPolicyBinding"]
ROLES = {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "ClusterRole"}
SPEC = POLICY["spec"]

CKPT = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
NS = "tenant-a"
KCM = "system:kube-controller-manager"


def controller(name: str) -> str:
    return f"system:serviceaccount:kube-system:{name}"


# ---- the CEL each expression may call ------------------------------------------

# Standard CEL, which Kubernetes has and cel-python implements (macros and functions).
STANDARD = {"has", "all", "exists", "exists_one", "map", "filter",
            "size", "matches", "startsWith", "endsWith", "contains", "string", "int", "bool"}
# Kubernetes' authorizer library, as the stand-in below provides it.
AUTHZ = {"group", "resource", "subresource", "namespace", "name", "check", "allowed", "reason", "errored", "error"}
_MACROS = {"has", "all", "exists", "exists_one", "map", "filter"}  # cel-python evaluates these itself


def _expressions() -> list[tuple[str, str]]:
    """(where, CEL) for every expression of the policy."""
    out = [(f"matchConditions[{c['name']}]", c["expression"]) for c in SPEC.get("matchConditions", [])]
    out += [(f"variables[{v['name']}]", v["expression"]) for v in SPEC.get("variables", [])]
    for i, v in enumerate(SPEC["validations"]):
        out.append((f"validations[{i}].expression", v["expression"]))
        if "messageExpression" in v:
            out.append((f"validations[{i}].messageExpression", v["messageExpression"]))
    out += [(f"auditAnnotations[{a['key']}]", a["valueExpression"]) for a in SPEC.get("auditAnnotations", [])]
    return out


ENV = celpy.Environment()


def _calls(cel: str) -> set[str]:
    """Every function, method and macro `cel` calls (a syntax error raises)."""
    names = set()
    for node in ENV.compile(cel).iter_subtrees():
        if node.data in ("member_dot_arg", "ident_arg", "dot_ident_arg"):
            token = node.children[1] if node.data == "member_dot_arg" else node.children[0]
            names.add(str(token))
    return names


def test_every_expression_parses_and_calls_only_what_kubernetes_and_the_stand_in_have() -> None:
    assert (STANDARD - _MACROS) <= set(base_functions)  # cel-python really has the standard ones named
    exprs = _expressions()
    assert len(exprs) >= 4
    for where, cel in exprs:
        unknown = _calls(cel) - STANDARD - AUTHZ
        assert not unknown, f"{where} calls {sorted(unknown)}, which the test environment does not provide"


def test_the_check_refuses_bad_cel() -> None:
    with pytest.raises(celpy.CELParseError):
        _calls("variables.after.filter(k, k.matches('x')")
    assert _calls("k.lowerAscii() == 'a'") - STANDARD - AUTHZ == {"lowerAscii"}  # Kubernetes-only
    assert _calls("[1].reduce(r, i, 0, r + i)") - STANDARD - AUTHZ == {"reduce"}  # cel-python-only


# ---- an RBAC-like authorizer ---------------------------------------------------


@dataclass(frozen=True)
class Rule:
    verbs: tuple[str, ...]
    groups: tuple[str, ...]
    resources: tuple[str, ...]
    names: tuple[str, ...] = ()

    @classmethod
    def of(cls, rule: dict[str, Any]) -> "Rule":
        return cls(tuple(rule["verbs"]), tuple(rule["apiGroups"]), tuple(rule["resources"]),
                   tuple(rule.get("resourceNames", ())))

    def allows(self, verb: str, group: str, resource: str, name: str) -> bool:
        """RBAC's rule match: `*` wildcards, and resourceNames only for a request that names one."""
        def has(values: tuple[str, ...], v: str) -> bool:
            return "*" in values or v in values
        return (has(self.verbs, verb) and has(self.groups, group) and has(self.resources, resource)
                and (not self.names or name in self.names))


@dataclass(frozen=True)
class Grant:
    """A RoleBinding (in `namespace`) or a ClusterRoleBinding (namespace None) of rules to a user."""
    user: str
    rules: tuple[Rule, ...]
    namespace: str | None = None


def role(name: str) -> tuple[Rule, ...]:
    return tuple(Rule.of(r) for r in ROLES[name]["rules"])


RBAC = (
    Grant("alice", role("node-agent-restore"), NS),
    Grant("carol", role("node-agent-restore") + role("node-agent-restore-host-access"), NS),
    Grant("dave", (Rule(("restore",), ("node-agent.io",), ("checkpoints",), (CKPT,)),), NS),
    Grant("erin", role("node-agent-restore")),
    Grant("pat", role("node-agent-restore-podcheckpoints"), NS),
    # Near misses: the wrong verb, group, resource.
    Grant("mallory", (Rule(("create", "update"), ("", "apps", "batch"), ("*",)),
                      Rule(("get",), ("node-agent.io",), ("checkpoints",)),
                      Rule(("restore",), ("node-agent.com",), ("checkpoints",)),
                      Rule(("restore",), ("node-agent.io",), ("pods",))), NS),
)


@dataclass(frozen=True)
class Authorizer:
    user: str
    grants: tuple[Grant, ...]


@dataclass(frozen=True)
class GroupCheck:
    authz: Authorizer
    group: str


@dataclass(frozen=True)
class ResourceCheck:
    authz: Authorizer
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str
    error: str = ""  # the stand-in's checks never fail


def _want(value: object, kind: type) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"no such overload for {type(value).__name__}")
    return value


def _group(a: object, g: object) -> GroupCheck:
    return GroupCheck(_want(a, Authorizer), str(_want(g, str)))


def _resource(gc: object, r: object) -> ResourceCheck:
    gc = _want(gc, GroupCheck)
    if not str(_want(r, str)).strip():
        raise ValueError("resource must not be empty")
    return ResourceCheck(gc.authz, gc.group, str(r))


def _setter(attr: str) -> Any:
    def set_(rc: object, v: object) -> ResourceCheck:
        rc = _want(rc, ResourceCheck)
        return ResourceCheck(**{**rc.__dict__, attr: str(_want(v, str))})
    return set_


def _check(rc: object, verb: object) -> Decision:
    rc = _want(rc, ResourceCheck)
    verb = str(_want(verb, str))
    res = rc.resource + ("/" + rc.subresource if rc.subresource else "")
    for g in rc.authz.grants:
        in_scope = g.namespace is None or (rc.namespace != "" and g.namespace == rc.namespace)
        if g.user == rc.authz.user and in_scope and any(r.allows(verb, rc.group, res, rc.name) for r in g.rules):
            return Decision(True, f"RBAC: allowed to {rc.authz.user} in {g.namespace or 'the cluster'}")
    return Decision(False, "")


FUNCTIONS = {
    "group": _group, "resource": _resource, "subresource": _setter("subresource"),
    "namespace": _setter("namespace"), "name": _setter("name"), "check": _check,
    "allowed": lambda d: ct.BoolType(_want(d, Decision).allowed),
    "reason": lambda d: ct.StringType(_want(d, Decision).reason),
    "errored": lambda d: ct.BoolType(_want(d, Decision).error != ""),
    "error": lambda d: ct.StringType(_want(d, Decision).error),
}
assert set(FUNCTIONS) == AUTHZ


def test_the_authorizer_stand_in_answers_as_rbac_does() -> None:
    def may(user: str, verb: str, ns: str, name: str = "", group: str = "node-agent.io") -> bool:
        rc = _resource(_group(Authorizer(user, RBAC), group), "checkpoints")
        return _check(_setter("name")(_setter("namespace")(rc, ns), name), verb).allowed
    assert may("alice", "restore", NS) and may("alice", "restore", NS, CKPT)
    assert not may("alice", "restore", "tenant-b") and not may("alice", "restore-host-access", NS)
    assert may("carol", "restore-host-access", NS)
    assert may("dave", "restore", NS, CKPT) and not may("dave", "restore", NS, OTHER) and not may("dave", "restore", NS)
    assert may("erin", "restore", "tenant-b")
    assert not any(may("mallory", v, NS) for v in ("restore", "restore-host-access"))
    assert not may("alice", "restore", NS, group="node-agent.com")


# ---- the admission steps -------------------------------------------------------

KINDS = {  # kind: (group, resource)
    "Pod": ("", "pods"), "ReplicationController": ("", "replicationcontrollers"), "Binding": ("", "bindings"),
    "Deployment": ("apps", "deployments"), "ReplicaSet": ("apps", "replicasets"),
    "StatefulSet": ("apps", "statefulsets"), "DaemonSet": ("apps", "daemonsets"),
    "Job": ("batch", "jobs"), "CronJob": ("batch", "cronjobs"),
}
WORKLOADS = ["Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job", "CronJob", "ReplicationController"]


@dataclass(frozen=True)
class Request:
    user: str
    obj: dict[str, Any]
    old: dict[str, Any] | None = None
    sub: str = ""
    namespace: str = NS
    operation: str = ""  # CREATE without `old`, UPDATE with it

    def op(self) -> str:
        return self.operation or ("UPDATE" if self.old is not None else "CREATE")


@dataclass
class Outcome:
    applies: bool = False
    messages: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.messages and not self.errors


def _matches(group: str, resource: str, op: str) -> bool:
    for rule in SPEC["matchConstraints"]["resourceRules"]:
        if (group in rule["apiGroups"] and op in rule["operations"] and resource in rule["resources"]
                and ("v1" in rule["apiVersions"] or "*" in rule["apiVersions"])):
            return True
    return False


@functools.cache
def _program(cel: str) -> celpy.Runner:
    return ENV.program(ENV.compile(cel), functions=FUNCTIONS)


def _eval(cel: str, activation: dict[str, Any]) -> Any:
    return _program(cel).evaluate(activation)


def admit(req: Request) -> Outcome:
    """What the API server decides on `req` with the policy and its binding in place."""
    kind = req.obj["kind"]
    group, resource = ("", "pods") if req.sub else KINDS[kind]
    out = Outcome()
    if not _matches(group, resource + ("/" + req.sub if req.sub else ""), req.op()):
        return out
    request = {
        "operation": req.op(), "namespace": req.namespace, "name": req.obj["metadata"].get("name", ""),
        "userInfo": {"username": req.user, "groups": ["system:authenticated"]},
        "resource": {"group": group, "version": "v1", "resource": resource}, "subResource": req.sub,
        "kind": {"group": group, "version": "v1", "kind": kind},
    }
    act: dict[str, Any] = {
        "object": celpy.json_to_cel(req.obj), "oldObject": celpy.json_to_cel(req.old),
        "request": celpy.json_to_cel(request), "authorizer": Authorizer(req.user, RBAC), "params": None,
    }
    try:
        for cond in SPEC.get("matchConditions", []):
            if not _eval(cond["expression"], act):
                return out
        out.applies = True
        variables: dict[Any, Any] = {}
        for var in SPEC.get("variables", []):  # in order: each sees those before it
            act["variables"] = ct.MapType(variables)
            variables[ct.StringType(var["name"])] = _eval(var["expression"], act)
        act["variables"] = ct.MapType(variables)
        for v in SPEC["validations"]:
            ok = _eval(v["expression"], act)
            assert isinstance(ok, ct.BoolType), v["expression"]
            if not ok:
                message = v.get("message", "")
                if "messageExpression" in v:
                    message = str(_eval(v["messageExpression"], act))
                out.messages.append(message)
    except celpy.CELEvalError as exc:  # failurePolicy: Fail
        out.errors.append(str(exc))
    return out


def test_the_binding_denies_with_the_policy_everywhere() -> None:
    assert BINDING["spec"] == {"policyName": POLICY["metadata"]["name"], "validationActions": ["Deny"]}
    assert SPEC["failurePolicy"] == "Fail" and "paramKind" not in SPEC


# ---- objects -------------------------------------------------------------------


def meta(annotations: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"name": "web", "namespace": NS, "labels": {"app": "web"}, **extra}
    if annotations is not None:
        m["annotations"] = annotations
    return m


def pod(annotations: dict[str, str] | None = None, owner: tuple[str, str] | None = None) -> dict[str, Any]:
    extra = {}
    if owner:
        extra["ownerReferences"] = [{"apiVersion": owner[0], "kind": owner[1], "name": "web-1", "uid": "u1",
                                     "controller": True, "blockOwnerDeletion": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta(annotations, **extra),
            "spec": {"containers": [{"name": "app", "image": "registry.example/app:1"}]}}


def workload(kind: str, annotations: dict[str, str] | None = None, owner: tuple[str, str] | None = None,
             replicas: int = 1) -> dict[str, Any]:
    template = {"metadata": meta(annotations) | {"name": ""}, "spec": pod()["spec"]}
    spec: dict[str, Any] = {"template": template}
    if kind == "CronJob":
        spec = {"schedule": "@hourly", "jobTemplate": {"metadata": {"annotations": {"team": "a"}}, "spec": spec}}
    elif kind not in ("Job", "DaemonSet"):
        spec["replicas"] = replicas
    obj = {"apiVersion": "batch/v1" if kind in ("Job", "CronJob") else "apps/v1", "kind": kind,
           "metadata": meta({"team": "a"}), "spec": spec}
    if owner:
        obj["metadata"]["ownerReferences"] = pod(owner=owner)["metadata"]["ownerReferences"]
    return obj


def make(kind: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return pod(annotations) if kind == "Pod" else workload(kind, annotations)


RESTORE = {RESTORE_FROM: CKPT}
HOST = {RESTORE_FROM: CKPT, ALLOW_HOST_ACCESS: "true"}


def allowed(req: Request) -> bool:
    out = admit(req)
    assert out.errors == [], out.errors  # never a CEL error: every outcome is the policy's decision
    return out.allowed


# ---- who may set them ----------------------------------------------------------


def test_the_policy_guards_exactly_the_keys_the_agent_reads() -> None:
    assert RESTORE_FROM == "checkpoint.node-agent.io/restore-from"
    assert ALLOW_HOST_ACCESS == "checkpoint.node-agent.io/allow-host-access"
    assert not allowed(Request("mallory", pod({RESTORE_FROM: CKPT})))
    assert not allowed(Request("mallory", pod({ALLOW_HOST_ACCESS: "true"})))


def test_a_pod_with_restore_from_needs_restore_in_its_namespace() -> None:
    assert allowed(Request("alice", pod(RESTORE)))
    assert allowed(Request("erin", pod(RESTORE)))  # bound cluster-wide
    assert not allowed(Request("mallory", pod(RESTORE)))
    assert not allowed(Request("alice", pod(RESTORE) | {"metadata": meta(RESTORE, namespace="tenant-b")},
                               namespace="tenant-b"))
    # A registry reference is the same request.
    assert not allowed(Request("mallory", pod({RESTORE_FROM: "registry.example/team/ckpt:v1"})))


def test_the_refusal_names_the_annotation_the_permission_and_the_user() -> None:
    (message,) = admit(Request("mallory", pod(RESTORE))).messages
    for word in (RESTORE_FROM, "verb restore ", "checkpoints", "node-agent.io", NS, "mallory", "node-agent-restore"):
        assert word in message
    (message,) = admit(Request("alice", workload("StatefulSet", HOST))).messages
    for word in (ALLOW_HOST_ACCESS, "restore-host-access", "pod template of a StatefulSet", "alice"):
        assert word in message


def test_a_podcheckpoint_by_name_needs_restore_on_podcheckpoints_and_nothing_else_does() -> None:
    by_name = pod({RESTORE_FROM: "podcheckpoint/model-warm"})
    assert allowed(Request("pat", by_name))
    assert not allowed(Request("alice", by_name))  # restore on checkpoints is not restore on podcheckpoints
    assert not allowed(Request("pat", pod({RESTORE_FROM: CKPT})))  # and the other way round
    assert not allowed(Request("pat", pod({RESTORE_FROM: "podcheckpoint/model-warm"}) | {
        "metadata": meta({RESTORE_FROM: "podcheckpoint/model-warm"}, namespace="tenant-b")}, namespace="tenant-b"))
    # The whitespace the agent trims before it looks for the prefix counts here too.
    for padded in (" podcheckpoint/x", "\tpodcheckpoint/x", "\n\r podcheckpoint/x"):
        assert allowed(Request("pat", pod({RESTORE_FROM: padded}))), repr(padded)
        assert not allowed(Request("alice", pod({RESTORE_FROM: padded}))), repr(padded)
    # A registry reference that merely contains the word is a registry reference.
    assert not allowed(Request("pat", pod({RESTORE_FROM: "registry.example/podcheckpoint/x:v1"})))
    (message,) = admit(Request("mallory", by_name)).messages
    assert "podcheckpoints" in message and "node-agent-restore-podcheckpoints" in message


@pytest.mark.parametrize("kind", WORKLOADS)
def test_a_workloads_pod_template_naming_a_podcheckpoint_needs_restore_on_podcheckpoints(kind: str) -> None:
    by_name = workload(kind, {RESTORE_FROM: "podcheckpoint/model-warm"})
    assert allowed(Request("pat", by_name))
    assert not allowed(Request("alice", by_name))


def test_resource_names_limit_a_grant_to_the_checkpoints_named() -> None:
    assert allowed(Request("dave", pod({RESTORE_FROM: CKPT})))
    assert not allowed(Request("dave", pod({RESTORE_FROM: OTHER})))


@pytest.mark.parametrize("kind", WORKLOADS)
def test_a_workloads_pod_template_is_held_to_the_same_rule(kind: str) -> None:
    assert not allowed(Request("mallory", workload(kind, RESTORE)))
    assert allowed(Request("alice", workload(kind, RESTORE)))
    assert not allowed(Request("alice", workload(kind, HOST)))
    assert allowed(Request("carol", workload(kind, HOST)))


def test_a_cronjobs_job_template_pod_template_is_what_counts() -> None:
    cron = workload("CronJob", RESTORE)
    assert cron["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["annotations"] == RESTORE
    assert not allowed(Request("mallory", cron))
    # The CronJob's own annotations and its Job's never reach a Pod.
    other = workload("CronJob")
    other["metadata"]["annotations"] = dict(RESTORE)
    other["spec"]["jobTemplate"]["metadata"]["annotations"] = dict(RESTORE)
    assert allowed(Request("mallory", other))


def test_allow_host_access_needs_its_own_permission() -> None:
    assert not allowed(Request("alice", pod(HOST)))
    out = admit(Request("alice", pod(HOST)))
    assert len(out.messages) == 1 and ALLOW_HOST_ACCESS in out.messages[0]
    assert allowed(Request("carol", pod(HOST)))
    # "false" asks for nothing; any other value asks (the agent refuses what is not true or false).
    assert allowed(Request("alice", pod({RESTORE_FROM: CKPT, ALLOW_HOST_ACCESS: "false"})))
    for value in ("True", " true", "yes", ""):
        assert not allowed(Request("alice", pod({RESTORE_FROM: CKPT, ALLOW_HOST_ACCESS: value}))), value
    # Without restore-from it does nothing on the node, and still needs the permission.
    assert not allowed(Request("mallory", pod({ALLOW_HOST_ACCESS: "true"})))
    assert allowed(Request("carol", pod({ALLOW_HOST_ACCESS: "true"})))


@pytest.mark.parametrize("kind", ["Pod"] + WORKLOADS)
def test_objects_without_the_annotations_are_always_allowed(kind: str) -> None:
    for annotations in (None, {}, {"example.com/note": RESTORE_FROM + "=" + CKPT},
                        {"checkpoint.node-agent.io/other": "x", "node-agent.io/restored-from": CKPT}):
        assert allowed(Request("mallory", make(kind, annotations)))
        out = admit(Request("mallory", make(kind, annotations)))
        assert out.applies  # judged, not skipped


@pytest.mark.parametrize("key", [
    "Checkpoint.Node-Agent.IO/Restore-From", "checkpoint.node-agent.io/RESTORE-FROM",
    " checkpoint.node-agent.io/restore-from", "checkpoint.node-agent.io/restore-from\t",
    "CHECKPOINT.NODE-AGENT.IO/ALLOW-HOST-ACCESS", "checkpoint.node-agent.io/allow-host-access ",
])
def test_odd_casing_or_whitespace_is_no_way_around(key: str) -> None:
    assert not allowed(Request("mallory", pod({key: "true" if "host" in key.lower() else CKPT})))
    assert not allowed(Request("mallory", workload("Deployment", {key: "true" if "host" in key.lower() else CKPT})))


# ---- UPDATE: only what the request changes ------------------------------------


def test_an_update_that_leaves_the_annotations_alone_is_allowed_for_anyone() -> None:
    dep = workload("Deployment", HOST)  # authorised by carol, earlier
    scaled = workload("Deployment", HOST, replicas=5)
    assert allowed(Request("mallory", scaled, old=dep))
    restarted = workload("Deployment", HOST | {"kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z"})
    assert allowed(Request("mallory", restarted, old=dep))
    labelled = pod(RESTORE)
    labelled["metadata"]["labels"]["tier"] = "front"
    assert allowed(Request("mallory", labelled, old=pod(RESTORE)))
    # The kubelet's status updates.
    assert allowed(Request("system:node:n1", pod(RESTORE), old=pod(RESTORE), sub="status"))


def test_an_update_that_adds_or_changes_one_needs_the_permission() -> None:
    for kind in ["Pod"] + WORKLOADS:
        assert not allowed(Request("mallory", make(kind, RESTORE), old=make(kind)))
        assert not allowed(Request("mallory", make(kind, {RESTORE_FROM: OTHER}), old=make(kind, RESTORE)))
        with_host = make(kind, RESTORE | {ALLOW_HOST_ACCESS: "true"})
        assert not allowed(Request("mallory", with_host, old=make(kind, RESTORE)))
        assert allowed(Request("alice", make(kind, RESTORE), old=make(kind)))
        # Removing one, or turning host access off, asks for nothing.
        assert allowed(Request("mallory", make(kind), old=make(kind, HOST)))
        assert allowed(Request("mallory", make(kind, RESTORE | {ALLOW_HOST_ACCESS: "false"}), old=make(kind, HOST)))
    # Through the status subresource, too.
    assert not allowed(Request("mallory", pod(RESTORE), old=pod(), sub="status"))


def test_a_binding_carrying_them_needs_the_permission() -> None:
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": meta(RESTORE),
               "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}
    assert not allowed(Request("system:kube-scheduler", binding, sub="binding"))
    assert not allowed(Request(KCM, binding, sub="binding"))
    assert not allowed(Request("mallory", binding))  # the legacy bindings resource
    # Whatever owner it names: a controller's exemption is for the objects it makes.
    owned = pod(owner=("apps/v1", "ReplicaSet"))["metadata"]["ownerReferences"]
    binding["metadata"] = meta(RESTORE, ownerReferences=owned)
    for user in (KCM, controller("replicaset-controller")):
        assert not allowed(Request(user, binding, sub="binding"))
    binding["metadata"] = meta()
    assert allowed(Request("system:kube-scheduler", binding, sub="binding"))


def test_requests_the_policy_does_not_match() -> None:
    assert not admit(Request("mallory", pod(RESTORE), operation="DELETE")).applies
    assert not _matches("apps", "deployments/scale", "UPDATE")
    assert not _matches("", "pods/ephemeralcontainers", "UPDATE")  # cannot change annotations


# ---- the requester is the author: controllers ----------------------------------

MADE_BY = [  # (kind made, its controller's owner, the controller's service account)
    ("Pod", ("apps/v1", "ReplicaSet"), "replicaset-controller"),
    ("Pod", ("batch/v1", "Job"), "job-controller"),
    ("Pod", ("apps/v1", "StatefulSet"), "statefulset-controller"),
    ("Pod", ("apps/v1", "DaemonSet"), "daemon-set-controller"),
    ("Pod", ("v1", "ReplicationController"), "replication-controller"),
    ("ReplicaSet", ("apps/v1", "Deployment"), "deployment-controller"),
    ("Job", ("batch/v1", "CronJob"), "cronjob-controller"),
]


def _made(kind: str, owner: tuple[str, str] | None, annotations: dict[str, str]) -> dict[str, Any]:
    return pod(annotations, owner) if kind == "Pod" else workload(kind, annotations, owner)


@pytest.mark.parametrize("kind,owner,sa", MADE_BY, ids=[m[2] for m in MADE_BY])
def test_a_controller_making_an_object_from_an_admitted_template_is_exempt(
        kind: str, owner: tuple[str, str], sa: str) -> None:
    obj = _made(kind, owner, HOST)
    for user in (controller(sa), KCM):
        out = admit(Request(user, obj))
        assert out.allowed and not out.applies, user
    # The same object from its author is judged.
    assert not allowed(Request("mallory", obj))


@pytest.mark.parametrize("kind,owner,sa", MADE_BY, ids=[m[2] for m in MADE_BY])
def test_the_exemption_is_that_controller_that_owner_and_create_only(
        kind: str, owner: tuple[str, str], sa: str) -> None:
    user = controller(sa)
    assert not allowed(Request(user, _made(kind, None, RESTORE)))  # no owner
    wrong = ("apps/v1", "Deployment") if owner[1] != "Deployment" else ("apps/v1", "StatefulSet")
    assert not allowed(Request(user, _made(kind, wrong, RESTORE)))  # another controller's object
    assert not allowed(Request(user, _made(kind, (owner[0].replace("v1", "v2"), owner[1]), RESTORE)))
    obj = _made(kind, owner, RESTORE)
    obj["metadata"]["ownerReferences"][0]["controller"] = False
    assert not allowed(Request(user, obj))  # an owner, not the controller
    others = [controller(m[2]) for m in MADE_BY if m[2] != sa]
    for other in others + [controller("generic-garbage-collector"), "system:serviceaccount:tenant-a:default"]:
        assert not allowed(Request(other, _made(kind, owner, RESTORE))), other
    # An UPDATE that adds one is the controller's own doing.
    assert not allowed(Request(user, _made(kind, owner, RESTORE), old=_made(kind, owner, {})))
    assert allowed(Request(user, _made(kind, owner, RESTORE), old=_made(kind, owner, RESTORE)))
