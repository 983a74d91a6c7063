"""deploy/monitoring/: the operator kit.

The PodMonitor and the PrometheusRule validate against the Prometheus
Operator's own CRD schemas (kept in data/prometheus-operator/, unknown
fields refused: tests/crdschema.py); the alert rules
pass Debian's `promtool check rules` and `promtool test rules`, with series
that must fire and series that must not; every query of the dashboard
parses, and the alerts and the dashboard read only series the agent exports.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from node_agent.metrics import Metrics
from tests.crdschema import strict
from tests.monitoring_kit import KIT, dashboard_queries, rule_groups, series_names

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).parent / "data" / "prometheus-operator"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"  # Debian's prometheus (scripts/install-host)


def _doc(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((KIT / name).read_text())
    return doc


def _validator(kind: str) -> jsonschema.Draft7Validator:
    crd = json.loads((SCHEMAS / f"{kind}.schema.json").read_text())
    schema = strict(crd["openAPIV3Schema"])
    schema["properties"]["metadata"] = {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                       "namespace": {"type": "string"}, "labels": {"type": "object"}},
        "additionalProperties": False,
    }
    return jsonschema.Draft7Validator(schema)


# ---- the manifests -----------------------------------------------------------


def test_the_component_holds_every_file_and_the_overlay_adds_it_to_the_agent() -> None:
    kit = _doc("kustomization.yaml")
    assert kit["kind"] == "Component"
    listed = set(kit["resources"]) | {f.split("=")[-1] for g in kit["configMapGenerator"] for f in g["files"]}
    assert listed == {p.name for p in KIT.iterdir() if p.name != "kustomization.yaml"}
    [dashboard] = kit["configMapGenerator"]
    assert dashboard["options"]["labels"] == {"grafana_dashboard": "1"}
    overlay = yaml.safe_load((REPO / "deploy" / "with-monitoring" / "kustomization.yaml").read_text())
    assert overlay["resources"] == [".."] and overlay["components"] == ["../monitoring"]
    assert overlay["namespace"] == yaml.safe_load((REPO / "deploy" / "kustomization.yaml").read_text())["namespace"]
    # `kubectl apply -k deploy/` stays free of the operator's kinds.
    assert "monitoring" not in (REPO / "deploy" / "kustomization.yaml").read_text().split("resources:")[1]


@pytest.mark.parametrize(("kind", "name"), [("podmonitor", "podmonitor.yaml"), ("prometheusrule", "prometheusrule.yaml")])
def test_the_manifests_validate_against_the_operators_crds(kind: str, name: str) -> None:
    doc = _doc(name)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"].lower() == kind
    _validator(kind).validate(doc)


def test_the_validation_refuses_an_unknown_field_and_a_bad_duration() -> None:
    rule = _doc("prometheusrule.yaml")
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["severity"] = "critical"  # belongs under labels
    with pytest.raises(jsonschema.ValidationError):
        _validator("prometheusrule").validate(bad)
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(jsonschema.ValidationError):
        _validator("prometheusrule").validate(bad)
    monitor = _doc("podmonitor.yaml")
    monitor["spec"]["podMetricsEndpoints"][0]["targetPort"] = {"name": "metrics"}
    with pytest.raises(jsonschema.ValidationError):
        _validator("podmonitor").validate(monitor)


def test_the_podmonitor_scrapes_the_daemonsets_metrics_port() -> None:
    ds = yaml.safe_load((REPO / "deploy" / "daemonset.yaml").read_text())
    pod = ds["spec"]["template"]
    monitor = _doc("podmonitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [agent] = [c for c in pod["spec"]["containers"] if any(p["name"] == endpoint["port"] for p in c["ports"])]
    [port] = [p["containerPort"] for p in agent["ports"] if p["name"] == endpoint["port"]]
    configmap = yaml.safe_load((REPO / "deploy" / "configmap.yaml").read_text())
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["metrics-listen"].rsplit(":", 1)[1] == str(port)
    assert endpoint["path"] == "/metrics"
    targets = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert targets["job"]["replacement"] == "node-agent"
    assert targets["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]


# ---- the rules, through promtool ---------------------------------------------------------------


def _rules_file(tmp: Path) -> Path:
    path = tmp / "node-agent.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    return path


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    cp = _promtool("check", "rules", str(_rules_file(tmp_path)), cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "SUCCESS: 8 rules found" in cp.stdout


NODE = 'job="node-agent", node="n1", instance="10.0.0.1:9441"'


def _alerts(name: str, at: str, *fired: tuple[dict[str, str], str, str]) -> dict[str, Any]:
    """At ``at``, alert ``name`` fires once for each of ``fired`` (its labels, summary and description)."""
    return {"eval_time": at, "alertname": name,
            "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary, "description": description}}
                           for labels, summary, description in fired]}


RULE_TESTS: list[dict[str, Any]] = [
    {   # An agent that stops answering; another that never did.
        "interval": "1m",
        "input_series": [
            {"series": f'up{{{NODE}}}', "values": "1 1 0x10"},
            {"series": 'up{job="node-agent", node="n2", instance="10.0.0.2:9441"}', "values": "1x12"},
        ],
        "alert_rule_test": [
            _alerts("NodeAgentDown", "5m"),  # 3 minutes down: not yet
            _alerts("NodeAgentDown", "8m", (
                {"severity": "critical", "job": "node-agent", "node": "n1", "instance": "10.0.0.1:9441"},
                "The node agent on n1 does not answer.",
                "Prometheus could not scrape the node agent on n1 for 5 minutes. On that node no pod can be "
                "checkpointed, no Pod annotated to restore can start, and device health goes unreported.")),
            _alerts("NodeAgentMissing", "8m"),
        ],
    },
    {   # No agent scraped at all.
        "interval": "1m",
        "input_series": [{"series": 'up{job="other"}', "values": "1x20"}],
        "alert_rule_test": [_alerts("NodeAgentMissing", "20m", (
            {"severity": "warning", "job": "node-agent"}, "No node agent is scraped.",
            'Prometheus has no target with job="node-agent": the DaemonSet runs no pod, or the PodMonitor selects '
            "none."))],
    },
    {   # Failures: a series that appears with its first failure fires; an old count that does not move does not.
        "interval": "1m",
        "input_series": [
            {"series": f'node_agent_failures_total{{{NODE}, operation="checkpoint", reason="FAILED_PRECONDITION"}}',
             "values": "_x5 1 1 1"},
            {"series": f'node_agent_failures_total{{{NODE}, operation="restore", reason="NOT_FOUND"}}',
             "values": "3x40"},
            {"series": f'node_agent_failures_total{{{NODE}, operation="pod-restore", reason="PERMISSION_DENIED"}}',
             "values": "0x30 1 1"},
        ],
        "alert_rule_test": [
            _alerts("NodeAgentCheckpointsFailing", "4m"),
            _alerts("NodeAgentCheckpointsFailing", "7m", (
                {"severity": "warning", "node": "n1", "reason": "FAILED_PRECONDITION"},
                "Checkpoints fail on n1 (FAILED_PRECONDITION).",
                "Checkpoints on n1 ended with FAILED_PRECONDITION in the last 15 minutes. The agent's log names the "
                "pod, the container, the phase and CRIU's decisive line (`kubectl logs` of the node's node-agent "
                "pod).")),
            _alerts("NodeAgentRestoresFailing", "29m"),
            _alerts("NodeAgentRestoresFailing", "32m", (
                {"severity": "warning", "node": "n1", "operation": "pod-restore", "reason": "PERMISSION_DENIED"},
                "Restores fail on n1 (pod-restore, PERMISSION_DENIED).",
                "Restores on n1 ended with PERMISSION_DENIED in the last 15 minutes (pod-restore: a Pod annotated "
                "checkpoint.node-agent.io/restore-from, whose events say why).")),
        ],
    },
    {   # Frozen windows: fifteen checkpoints under 1 s, then one of 2.5 s.
        "interval": "1m",
        "input_series": [
            {"series": f'node_agent_checkpoint_frozen_seconds_count{{{NODE}}}', "values": "0+1x15 16 16 16"},
            {"series": f'node_agent_checkpoint_frozen_seconds_bucket{{{NODE}, le="1.0"}}',
             "values": "0+1x15 15 15 15"},
        ],
        "alert_rule_test": [
            _alerts("NodeAgentLongFreeze", "15m"),
            _alerts("NodeAgentLongFreeze", "18m", (
                {"severity": "warning", "node": "n1"}, "Pods on n1 stay frozen longer than 1 s while checkpointed.",
                "1 checkpoint(s) on n1 kept their pod frozen longer than 1 s in the last 15 minutes: its clients "
                "waited that long. Large memory dumped at once, a slow disk under the store, or pre-dump not used "
                "for a large pod.")),
        ],
    },
    {   # The store: plenty free, then under twice the floor, then at the floor.
        "interval": "1m",
        "input_series": [
            {"series": f'node_agent_store_min_free_bytes{{{NODE}}}', "values": "1073741824x40"},
            {"series": f'node_agent_store_free_bytes{{{NODE}}}',
             "values": "10737418240x10 1610612736x15 1073741824x15"},
        ],
        "alert_rule_test": [
            _alerts("NodeAgentStoreLow", "10m"),
            _alerts("NodeAgentStoreFull", "10m"),
            _alerts("NodeAgentStoreLow", "22m", (
                {"severity": "warning", "job": "node-agent", "node": "n1", "instance": "10.0.0.1:9441"},
                "The checkpoint store on n1 is nearly full.",
                "1.5GiB free under the store of n1, less than twice the min-free-bytes every checkpoint and pull "
                "leaves free. Remove checkpoints or tighten retention.")),
            _alerts("NodeAgentStoreFull", "22m"),
            _alerts("NodeAgentStoreFull", "32m", (
                {"severity": "critical", "job": "node-agent", "node": "n1", "instance": "10.0.0.1:9441"},
                "The checkpoint store on n1 has no room left.",
                "Only 1GiB free under the store of n1, at or below min-free-bytes: checkpoints and pulls there are "
                "refused (RESOURCE_EXHAUSTED).")),
        ],
    },
    {   # Devices: a taint with effect None is only a note; NoSchedule alerts.
        "interval": "1m",
        "input_series": [
            {"series": f'node_agent_devices_tainted{{{NODE}, effect="None"}}', "values": "1x10"},
            {"series": f'node_agent_devices_tainted{{{NODE}, effect="NoSchedule"}}', "values": "0x4 1x5"},
            {"series": f'node_agent_devices_tainted{{{NODE}, effect="NoExecute"}}', "values": "0x10"},
        ],
        "alert_rule_test": [
            _alerts("NodeAgentDeviceTainted", "3m"),
            _alerts("NodeAgentDeviceTainted", "6m", (
                {"severity": "warning", "node": "n1", "effect": "NoSchedule"}, "1 device(s) on n1 tainted NoSchedule.",
                "The node agent on n1 taints 1 device(s) with effect NoSchedule (a DeviceTaintRule each): new claims "
                "avoid them. `node-agent devices` on the node says why.")),
        ],
    },
]


def test_promtool_tests_the_alerts_with_series_that_fire_and_series_that_must_not(tmp_path: Path) -> None:
    rules = _rules_file(tmp_path)
    tests = tmp_path / "node-agent.tests.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": RULE_TESTS},
                                    sort_keys=False))
    cp = _promtool("test", "rules", str(tests), cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "SUCCESS" in cp.stdout


def test_a_wrong_expectation_fails_promtool(tmp_path: Path) -> None:
    """The rule tests can fail: a device tainted NoSchedule that is said not to alert."""
    rules = _rules_file(tmp_path)
    wrong = copy.deepcopy(RULE_TESTS[-1])
    wrong["alert_rule_test"] = [_alerts("NodeAgentDeviceTainted", "6m")]
    tests = tmp_path / "wrong.tests.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [rules.name], "tests": [wrong]}, sort_keys=False))
    cp = _promtool("test", "rules", str(tests), cwd=tmp_path)
    assert cp.returncode != 0 and "NodeAgentDeviceTainted" in cp.stdout + cp.stderr


# ---- the dashboard -------------------------------------------------------------------------------


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": q} for i, q in enumerate(queries)]}]}))
    cp = _promtool("check", "rules", str(path), cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def exported_series() -> set[str]:
    """The names of the series an agent exports, every gauge's callback set."""
    m = Metrics()
    m.store_size = lambda: 1
    m.store_free = lambda: 1
    m.min_free_bytes = 1
    m.failures.labels(operation="checkpoint", reason="INTERNAL").inc()
    return {line.split("{")[0].split(" ")[0] for line in m.render().splitlines() if line and line[0] != "#"}


def test_the_alerts_and_the_dashboard_read_only_series_the_agent_exports() -> None:
    exported = exported_series() | {"up"}
    rules = [r["expr"] for g in rule_groups() for r in g["rules"]]
    used = {name for expr in [*rules, *dashboard_queries()] for name in series_names(expr)}
    assert used - exported == set()
    # Each signal the kit is for is read by the dashboard too.
    shown = {name for q in dashboard_queries() for name in series_names(q)}
    assert {"up", "node_agent_failures_total", "node_agent_checkpoint_frozen_seconds_bucket",
            "node_agent_store_free_bytes", "node_agent_store_min_free_bytes", "node_agent_devices_tainted",
            "node_agent_devices", "node_agent_checkpoints_total"} <= shown
