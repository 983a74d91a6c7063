"""DeviceTaintRules: which ones the agent wants, their manifests, and applying them.

`desired_rules()` makes one rule per published device and counted reason
(none for a device no DRA driver publishes). New taints have effect None;
an unhealthy condition escalates one step per `escalate-after` up to
`max-effect`. `TaintWriter` brings the API server's rules (the ones this
agent labelled for this node) to the desired set: create, replace, delete,
each write taking a token from a bucket so a flapping device cannot flood
the API server; a write without a token waits for a later round.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from typing import Any, Iterable, Mapping

from node_agent import errors
from node_agent.config.schema import Devices
from node_agent.kubeapi import KubeClient
from node_agent.devices.ratelimit import TokenBucket
from node_agent.devices.types import UNHEALTHY, DeviceReport, DraDevice, Reason, TaintRule

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
KIND = "DeviceTaintRule"
EFFECTS = ("None", "NoSchedule", "NoExecute")
KEY_PREFIX = "health.node-agent.io/"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_NODE = "node-agent.io/node"
LABEL_REASON = "node-agent.io/reason"
ANN_BUS_ID = "node-agent.io/pci-bus-id"
ANN_MESSAGE = "node-agent.io/message"
MANAGER = "node-agent"
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _digest(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()


def label_value(text: str) -> str:
    """`text` if it is a valid label value, else a stable digest of it."""
    if len(text) <= 63 and re.fullmatch(r"([A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?)?", text):
        return text
    return "h-" + _digest(text)[:40]


def rule_name(node: str, bdf: str, reason: str, target: DraDevice, several: bool) -> str:
    """Stable per node, device and reason (and DRA device, when one PCI function has several)."""
    dev = bdf.replace(":", "-").replace(".", "-")
    tail = f"{reason}-{_digest(target.driver, target.pool, target.device)[:8]}" if several else reason
    name = f"{node.lower()}.{dev}.{tail}"
    if len(name) <= 253 and all(_DNS_LABEL.match(part) for part in name.split(".")):
        return name
    return "node-agent-" + _digest(node, bdf, tail)[:40]


def effect_for(reason: Reason, wall_now: float, policy: Devices) -> str:
    """None first; an unhealthy condition climbs one step per `escalate-after`, up to `max-effect`."""
    if reason.severity != UNHEALTHY:
        return "None"
    steps = int(max(wall_now - reason.since, 0.0) // policy.escalate_after) if policy.escalate_after > 0 else 2
    return EFFECTS[min(steps, 2, EFFECTS.index(policy.max_effect))]


def desired_rules(node: str, reports: Iterable[DeviceReport], wall_now: float, policy: Devices) -> tuple[TaintRule, ...]:
    out = []
    for rep in reports:
        for reason in rep.health.reasons:
            for target in rep.dra:
                out.append(TaintRule(
                    name=rule_name(node, rep.pci.bdf, reason.reason, target, len(rep.dra) > 1),
                    node=node, bdf=rep.pci.bdf, reason=reason.reason, target=target,
                    key=KEY_PREFIX + reason.reason, value=reason.severity,
                    effect=effect_for(reason, wall_now, policy), message=reason.message,
                ))
    return tuple(sorted(out, key=lambda r: r.name))


def selector(node: str) -> str:
    return f"{LABEL_MANAGED}={MANAGER},{LABEL_NODE}={label_value(node)}"


def manifest(rule: TaintRule) -> dict[str, Any]:
    """The DeviceTaintRule object (as `kubectl apply` and the API server take it)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": rule.name,
            "labels": {LABEL_MANAGED: MANAGER, LABEL_NODE: label_value(rule.node), LABEL_REASON: label_value(rule.reason)},
            "annotations": {ANN_BUS_ID: rule.bdf, ANN_MESSAGE: rule.message[:1024]},
        },
        "spec": {
            "deviceSelector": {"driver": rule.target.driver, "pool": rule.target.pool, "device": rule.target.device},
            "taint": {"key": rule.key, "value": rule.value, "effect": rule.effect},
        },
    }


def _same(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    hs, ws = have.get("spec") or {}, want["spec"]
    if not isinstance(hs, Mapping):
        return False
    raw = hs.get("taint")
    ht: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    return bool(
        hs.get("deviceSelector") == ws["deviceSelector"]
        and all(ht.get(k) == ws["taint"][k] for k in ("key", "value", "effect"))
    )


class TaintWriter:
    """Keeps the API server's rules for this node equal to the desired ones, at a bounded write rate."""

    def __init__(self, client: KubeClient, node: str, bucket: TokenBucket, timeout: float) -> None:
        self.client = client
        self.node = node
        self.bucket = bucket
        self.timeout = timeout
        self.actual: dict[str, Mapping[str, Any]] | None = None
        self.deferred = 0  # writes waiting for a token after the last round

    async def _call(self, fn: Any, *args: Any) -> Any:
        async with asyncio.timeout(self.timeout + 1.0):
            return await asyncio.to_thread(fn, *args)

    async def refresh(self) -> None:
        items = await self._call(self.client.list_taint_rules, selector(self.node))
        actual: dict[str, Mapping[str, Any]] = {}
        for item in items:
            meta = item.get("metadata") if isinstance(item, Mapping) else None
            if isinstance(meta, Mapping) and isinstance(meta.get("name"), str):
                actual[meta["name"]] = item
        self.actual = actual

    async def sync(self, rules: Iterable[TaintRule], relist: bool = False) -> None:
        """One round: relist when asked or unknown, then the writes the bucket allows."""
        if self.actual is None or relist:
            await self.refresh()
        assert self.actual is not None
        want = {r.name: (r, manifest(r)) for r in rules}
        creates = [n for n in want if n not in self.actual]
        updates = [n for n in want if n in self.actual and not _same(self.actual[n], want[n][1])]
        deletes = [n for n in self.actual if n not in want]
        self.deferred = 0
        for kind, names in (("create", creates), ("update", updates), ("delete", deletes)):
            for name in names:
                if not self.bucket.try_take():
                    self.deferred += 1
                    continue
                try:
                    await self._write(kind, name, want.get(name))
                except errors.AgentError as exc:
                    log.warning("DeviceTaintRule %s: %s failed: %s", name, kind, exc, extra={"phase": "devices"})
                    self.actual = None  # relist next round
                    return
        if self.deferred:
            log.info("%d DeviceTaintRule write(s) wait for the rate limit", self.deferred, extra={"phase": "devices"})

    async def _write(self, kind: str, name: str, want: tuple[TaintRule, dict[str, Any]] | None) -> None:
        assert self.actual is not None
        if kind == "delete":
            try:
                await self._call(self.client.delete_taint_rule, name)
            except errors.NotFound:
                pass
            old = self.actual.pop(name)
            log.warning("DeviceTaintRule %s deleted (%s recovered)", name,
                        (old.get("metadata") or {}).get("labels", {}).get(LABEL_REASON, "condition"),
                        extra={"phase": "devices"})
            return
        assert want is not None
        rule, body = want
        if kind == "create":
            self.actual[name] = await self._call(self.client.create_taint_rule, body)
            log.warning("DeviceTaintRule %s created: %s=%s:%s on %s/%s/%s (%s)", name, rule.key, rule.value, rule.effect,
                        rule.target.driver, rule.target.pool, rule.target.device, rule.message,
                        extra={"phase": "devices", "device": rule.bdf, "reason": rule.reason})
            return
        meta = self.actual[name].get("metadata") or {}
        if meta.get("resourceVersion"):
            body = dict(body, metadata=dict(body["metadata"], resourceVersion=str(meta["resourceVersion"])))
        self.actual[name] = await self._call(self.client.replace_taint_rule, name, body)
        log.warning("DeviceTaintRule %s updated: effect %s (%s)", name, rule.effect, rule.message,
                    extra={"phase": "devices", "device": rule.bdf, "reason": rule.reason})
