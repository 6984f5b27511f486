"""The shipped alert rules (monitoring/alerts.yml) are valid, unit-tested and point to real runbooks.

``promtool check rules`` and ``promtool test rules`` run on the shipped files; every alert must have a
case in monitoring/alerts_test.yml where it fires and one where it does not; every rule reads only
metrics monitoring/metrics.py defines, and carries what an on-call engineer needs (a severity, a summary
and a description naming where the problem is, and a runbook section that exists in docs/operations.md).
That a real Prometheus loads and evaluates the rules against a real broker's metrics is checked in
test_dashboards_in_prometheus.py and test_cluster_dashboard_in_prometheus.py.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.monitoring.monitoring_helpers import ALERT_RULES as ALERTS
from tests.monitoring.monitoring_helpers import alert_rules, exposed_names, require_tool

REPO = Path(__file__).resolve().parents[2]
ALERT_TESTS = REPO / "monitoring" / "alerts_test.yml"
OPERATIONS = REPO / "docs" / "operations.md"
SEVERITIES = {"critical", "warning", "info"}
RUNBOOK = re.compile(r"^docs/operations\.md#([a-z0-9_-]+)$")
METRIC = re.compile(r"\b((?:conveyor|process|python)_[a-zA-Z0-9_]+)\b")


@cache
def alert_cases() -> list[dict[str, Any]]:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    return [case for test in tests for case in test.get("alert_rule_test", [])]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=REPO / "monitoring"
    )


def test_promtool_check_rules_accepts_the_alert_rules() -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_promtool_unit_tests_of_the_alert_rules_pass() -> None:
    done = promtool("test", "rules", str(ALERT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not() -> None:
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names)), "two rules share an alert name"
    firing = {case["alertname"] for case in alert_cases() if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in alert_cases() if not case.get("exp_alerts")}
    assert not set(names) - firing, f"alerts without a firing case: {sorted(set(names) - firing)}"
    assert not set(names) - quiet, f"alerts without a non-firing case: {sorted(set(names) - quiet)}"
    assert not (firing | quiet) - set(names), (
        f"cases for alerts that do not exist: {sorted((firing | quiet) - set(names))}"
    )


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_says_how_bad_where_and_what_to_do(rule: dict[str, Any]) -> None:
    assert rule["labels"]["severity"] in SEVERITIES
    annotations = rule["annotations"]
    assert {"summary", "description", "runbook"} <= set(annotations)
    assert "$labels.instance" in annotations["description"], "the description must name the instance"
    assert RUNBOOK.match(annotations["runbook"]), annotations["runbook"]


def test_every_runbook_is_a_section_of_the_operations_doc() -> None:
    anchors = github_anchors(OPERATIONS.read_text())
    missing = [
        rule["annotations"]["runbook"]
        for rule in alert_rules()
        if rule["annotations"]["runbook"].partition("#")[2] not in anchors
    ]
    assert not missing, f"runbook sections missing from docs/operations.md: {missing}"


def test_the_rules_and_their_tests_read_only_metrics_conveyor_exports() -> None:
    exported = exposed_names()
    used = {name for rule in alert_rules() for name in METRIC.findall(rule["expr"])}
    assert used, "no metric found in the rules"
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    used |= {name for test in tests for s in test["input_series"] for name in METRIC.findall(s["series"].split("{")[0])}
    assert not used - exported, f"metrics monitoring/metrics.py does not define: {sorted(used - exported)}"
