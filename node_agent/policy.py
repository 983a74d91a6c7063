"""The node's checkpoint and restore policy per namespace (`namespaces:`), decided and described.

Rule: one decision for every path. The checkpointer asks it for the pod's
namespace once the pod is resolved, the restorer for the namespace the
restored pod lands in, before anything is frozen or made; the local socket,
the mutual-TLS listener (on top of its `authorization:` rules), CRI
CheckpointPod/RestorePod and restore through a Pod all reach it there. A
namespace's own rule decides; a field it leaves unset (or a namespace
without a rule) falls back to the rule of "*"; where neither says, the
action is allowed. Pure: reads Settings, no I/O.

Restore through a Pod takes its checkpoint and options from the Pod's
annotations, which anyone who may create a Pod writes: `pod_sources`
says which namespaces' checkpoints a Pod may name (its own, plus
`restore.pod-sources`), `require_pod_host_access` where its annotation may
allow host access (`restore.pod-host-access-namespaces`).

`describe` words the whole effective policy (namespaces, restore rules,
signing, encryption) as lines for `doctor --deployment`: names, paths and
public keys as configured, never key material.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from node_agent import errors
from node_agent.config.schema import NamespaceRule, Settings

Action = Literal["checkpoint", "restore"]
ACTIONS: tuple[Action, ...] = ("checkpoint", "restore")
DEFAULT = "*"


@dataclass(frozen=True)
class Decision:
    allowed: bool
    # The config key that decides (`namespaces["kube-system"].restore`); "" when none
    # does and the built-in default (allowed) applies.
    key: str = ""
    # Decided by "*" for a namespace that sets nothing of its own for the action.
    fallback: bool = False


def _key(namespace: str, action: Action) -> str:
    return f'namespaces["{namespace}"].{action}'


def decide(settings: Settings, action: Action, namespace: str) -> Decision:
    """Whether `action` is allowed for `namespace`, and which key says so."""
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    rules = settings.namespaces
    own = rules.get(namespace) if namespace != DEFAULT else None
    if own is not None and getattr(own, action) is not None:
        return Decision(bool(getattr(own, action)), _key(namespace, action))
    default = rules.get(DEFAULT)
    if default is not None and getattr(default, action) is not None:
        return Decision(bool(getattr(default, action)), _key(DEFAULT, action), fallback=True)
    return Decision(True)


def allowed(settings: Settings, action: Action, namespace: str) -> bool:
    return decide(settings, action, namespace).allowed


def require(settings: Settings, action: Action, namespace: str, pod: str) -> None:
    """PERMISSION_DENIED unless `action` is allowed for `namespace`; `pod` (namespace/name) names the pod.

    The message names the action, the pod and the key that refuses it.
    """
    d = decide(settings, action, namespace)
    if d.allowed:
        return
    why = f"{d.key} is false"
    if d.fallback:
        why += f' and namespaces["{namespace}"] does not set {action}'
    what = f"checkpoint of pod {pod}" if action == "checkpoint" else f"restore as pod {pod}"
    raise errors.PermissionDenied(f"{what}: refused by this node's policy: {why}")


# ---- restore through a Pod: its annotations are whoever may create Pods' -----------


def pod_sources(settings: Settings, target: str) -> frozenset[str]:
    """The namespaces whose checkpoints a Pod in `target` may name in `restore-from` ("*": any).

    Its own namespace always; more only where `restore.pod-sources` lists
    them for `target` or for "*".
    """
    rules = settings.restore.pod_sources
    return frozenset({target, *rules.get(target, ()), *rules.get(DEFAULT, ())})


def pod_may_restore_from(settings: Settings, source: str, target: str) -> bool:
    allowed_sources = pod_sources(settings, target)
    return DEFAULT in allowed_sources or source in allowed_sources


def require_pod_host_access(settings: Settings, namespace: str, pod: str) -> None:
    """PERMISSION_DENIED unless Pods in `namespace` may allow host access by annotation."""
    listed = settings.restore.pod_host_access_namespaces
    if namespace in listed or DEFAULT in listed:
        return
    raise errors.PermissionDenied(
        f"restore as pod {pod}: the Pod's annotation allows host access, which this node honours only in "
        "namespaces listed in restore.pod-host-access-namespaces"
        + (f" ({', '.join(listed)})" if listed else " (none)")
    )


# ---- the effective policy, in words ------------------------------------------------


def _word(value: bool) -> str:
    return "allowed" if value else "refused"


def _rule_line(settings: Settings, namespace: str) -> str:
    parts = []
    for action in ACTIONS:
        d = decide(settings, action, namespace)
        parts.append(f"{action} {_word(d.allowed)}"
                     + (' (as "*")' if d.fallback else "" if d.key else " (nothing set)"))
    return f'namespaces["{namespace}"]: ' + ", ".join(parts)


def describe(settings: Settings) -> list[str]:
    """The effective policy, one line per setting; paths, names and public keys only."""
    rules = settings.namespaces
    default = rules.get(DEFAULT, NamespaceRule())
    said = [f"{a} {_word(getattr(default, a) is not False)}"
            + ("" if getattr(default, a) is not None else " (nothing set)") for a in ACTIONS]
    out = [f'namespaces["*"] (every namespace without its own rule): {", ".join(said)}']
    out += [_rule_line(settings, ns) for ns in sorted(rules) if ns != DEFAULT]
    r = settings.restore
    out.append(f"restore.require-signature: {'true' if r.require_signature else 'false'}")
    if r.trusted_keys:
        for ns in sorted(r.trusted_keys):
            keys = r.trusted_keys[ns]
            out.append(f'restore.trusted-keys["{ns}"]: ' + (", ".join(keys) if keys else "none"))
    else:
        out.append("restore.trusted-keys: none")
    out.append("restore.pod-sources (restore-from across namespaces): " + (
        "; ".join(f"into {t}: from {', '.join(r.pod_sources[t]) or 'none'}" for t in sorted(r.pod_sources))
        or "none (a Pod restores only checkpoints of its own namespace)"))
    out.append("restore.pod-registries: " + (", ".join(r.pod_registries)
                                             or "none (registry references in restore-from are refused)"))
    out.append("restore.pod-credentials (the node's registry logins for restore-from): " + (
        "; ".join(f"in {t}: {', '.join(r.pod_credentials[t]) or 'none'}" for t in sorted(r.pod_credentials))
        or "none (Pods pull without the node's logins)"))
    out.append("restore.pod-host-access-namespaces: " + (", ".join(r.pod_host_access_namespaces) or "none"))
    out.append("restore.allow-foreign: " + ("true" if r.allow_foreign else
                                            "false (checkpoints imported from CRI-O, Podman or containerd "
                                            "archives are not restored)"))
    out.append("signing.key-file: " + (f"{settings.signing.key_file} (new checkpoints are signed)"
                                       if settings.signing.key_file else "none (checkpoints are published unsigned)"))
    e = settings.encryption
    if e.key_sources:
        # An exec source's arguments may carry a token: its program alone is shown.
        sources = [f"{s.kind} {s.exec[0]}" + (f" ({len(s.exec) - 1} argument(s))" if len(s.exec) > 1 else "")
                   if s.kind == "exec" else f"{s.kind} {s.where}" for s in e.key_sources]
        out.append("encryption.key-sources: " + "; ".join(sources))
    else:
        out.append("encryption.key-sources: none (checkpoint data is not encrypted)")
    if e.domains:
        out.append("encryption.domains: " + "; ".join(f"{name}: {', '.join(e.domains[name]) or 'no namespace'}"
                                                      for name in sorted(e.domains)))
    else:
        out.append("encryption.domains: none (each namespace is a domain of its own)")
    return out
