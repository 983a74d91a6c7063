"""deploy/monitoring/, as the tests read it: the alert rules, the dashboard's queries, the series they read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

KIT = Path(__file__).resolve().parents[1] / "deploy" / "monitoring"


def rule_groups() -> list[dict[str, Any]]:
    """The PrometheusRule's groups, as a Prometheus rule file holds them."""
    groups: list[dict[str, Any]] = yaml.safe_load((KIT / "prometheusrule.yaml").read_text())["spec"]["groups"]
    return groups


def dashboard_queries() -> list[str]:
    """Every query of the dashboard, with Grafana's variables as a query run for every node would have them."""
    board = json.loads((KIT / "dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    return [e.replace("$__rate_interval", "2m").replace("$node", ".*") for e in exprs]


def series_names(expr: str) -> set[str]:
    """The names of the series a query selects (each is written with a label matcher)."""
    return set(re.findall(r"\b((?:node_agent|process)_[a-z_]+|up)\b(?=\s*\{)", expr))
