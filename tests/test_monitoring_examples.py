"""examples/monitoring: the alert rules parse as YAML rule groups, the
dashboard as JSON, and every metric either names is one Apiary exports
(jobqueue.metrics.EXPORTED) or Prometheus' own `up` — a renamed metric
cannot leave an alert silently watching nothing."""

import json
import re
from pathlib import Path

import yaml

from jobqueue.metrics import EXPORTED

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "monitoring"
PROMETHEUS_OWN = {"up"}
PROMQL_WORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not a
    function or aggregation (followed by "("), a keyword, a label matcher, a
    grouping clause, a range or a string."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if not rest.startswith("(") and match.group().lower() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def rules() -> list[dict]:
    document = yaml.safe_load((EXAMPLES / "apiary-alerts.yml").read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_reader_finds_metric_names_and_nothing_else():
    expr = 'histogram_quantile(0.99, sum by (le) (rate(apiary_x_bucket{a="b c"}[5m]))) > 1 and on() up offset 1h'
    assert metric_names(expr) == {"apiary_x_bucket", "up"}


def test_the_alert_rules_parse_and_name_only_exported_metrics():
    found = rules()
    assert found and all({"alert", "expr"} <= set(rule) for rule in found)
    for rule in found:
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= set(EXPORTED) | PROMETHEUS_OWN, (rule["alert"], names - set(EXPORTED))


def test_the_rules_cover_queued_growth_stale_heartbeats_and_lease_expiries():
    watched = {name for rule in rules() for name in metric_names(rule["expr"])}
    assert {"apiary_jobs", "apiary_workers", "apiary_lease_expiries_total"} <= watched


def test_the_dashboard_parses_and_names_only_exported_metrics():
    exprs = dashboard_exprs()
    assert exprs
    used = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names and names <= set(EXPORTED), (expr, names - set(EXPORTED))
        used |= names
    assert used == set(EXPORTED)  # and shows every one of them
