"""The node's checkpoint and restore policy per namespace (`namespaces:`), decided and described.

Rule: one decision for every path. The checkpointer asks it for the pod's
namespace once the pod is resolved, the restorer for the namespace the
restored pod lands in, before anything is frozen or made; the local socket,
the mutual-TLS listener (on top of its `authorization:` rules), CRI
CheckpointPod/RestorePod and restore through a Pod all reach it there. A
namespace's own rule decides; a field it leaves unset (or a namespace
without a rule) falls back to the rule of "*"; where neither says, the
action is allowed. Pure: reads Settings, no I/O.

`describe` words the whole effective policy (namespaces, restore rules,
signing, encryption) as lines for `doctor --deployment`: names, paths and
public keys as configured, never key material.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from node_agent import errors
from node_agent.config import NamespaceRule, Settings

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
