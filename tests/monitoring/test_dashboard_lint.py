"""The shipped Grafana dashboards follow one set of conventions (RabbitMQ's dashboards are the model).

Imported through the UI, Grafana asks for the DS_PROMETHEUS input; provisioned, the hidden datasource
variable of the same name resolves ``${DS_PROMETHEUS}``. Every query must use only metrics monitoring/
registers, so a renamed metric breaks this test, not a dashboard in production.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest

from tests.monitoring.dashboard_helpers import (
    BUILTIN_VARIABLES,
    DATASOURCE,
    GRAFANA,
    all_queries,
    label_values_query,
    load_dashboards,
    metric_names,
    panels,
    queries,
    query_panels,
    variable_query,
    variables,
    variables_used,
    without_strings,
)
from tests.monitoring.monitoring_helpers import exposed_names

SCHEMA_VERSION = 39
EXPECTED = {
    "conveyor-broker-overview",
    "conveyor-consumer-groups",
    "conveyor-storage",
    "conveyor-consumers",
    "conveyor-cluster",
}
# Dashboards whose every number is one broker's (the cluster's sums count each partition once on its leader,
# and the runners of a group are added up on purpose).
PER_BROKER = {"conveyor-broker-overview.json", "conveyor-consumer-groups.json", "conveyor-storage.json"}
AGGREGATION = re.compile(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(")
PROMETHEUS_SERIES = {"up"}  # Prometheus' own series per target
_STRING_CONTENT = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHER_SPANS = re.compile(r"\{[^{}]*\}")
_METRIC_AT = re.compile(r"(?<![\w:$])([a-zA-Z_:][a-zA-Z0-9_:]*)")
WITHOUT_GROUPS = {"conveyor-storage.json", "conveyor-cluster.json"}  # neither shows anything per group
RATE_FUNCTIONS = re.compile(r"\b(rate|irate|increase)\s*\(")
HEATMAP_QUERY = re.compile(r"^sum by \(le\) \(rate\([a-z_:][a-z0-9_:]*_bucket(\{[^{}]*\})?\[\$__rate_interval\]\)\)$")
DASHBOARDS = load_dashboards()
IDS = sorted(DASHBOARDS)


def _call_argument(expr: str, open_paren: int) -> str:
    depth = 0
    for i in range(open_paren, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return expr[open_paren + 1 : i]
    raise AssertionError(f"unbalanced parentheses in {expr}")


def test_the_dashboards_ship_with_pinned_unique_uids() -> None:
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert set(uids) >= EXPECTED, f"missing dashboards: {EXPECTED - set(uids)}"
    assert len(uids) == len(set(uids)), f"duplicate uids: {[u for u, n in Counter(uids).items() if n > 1]}"
    titles = [d["title"] for d in DASHBOARDS.values()]
    assert len(titles) == len(set(titles)), "duplicate titles"


@pytest.mark.parametrize("name", IDS)
def test_dashboard_is_shareable(name: str) -> None:
    dashboard = DASHBOARDS[name]
    assert dashboard["id"] is None, "id must be null so imports never overwrite another dashboard"
    assert isinstance(dashboard["uid"], str) and 0 < len(dashboard["uid"]) <= 40
    assert dashboard["schemaVersion"] == SCHEMA_VERSION
    assert dashboard.get("description"), "the dashboard needs a description"
    assert "conveyor" in dashboard.get("tags", [])
    inputs = {i["name"]: i for i in dashboard.get("__inputs", [])}
    assert set(inputs) == {"DS_PROMETHEUS"}, "exactly one input: the Prometheus datasource"
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"


@pytest.mark.parametrize("name", IDS)
def test_one_hidden_datasource_variable_used_by_every_panel_and_target(name: str) -> None:
    dashboard = DASHBOARDS[name]
    datasource_vars = [v for v in variables(dashboard) if v["type"] == "datasource"]
    assert len(datasource_vars) == 1, "exactly one datasource variable"
    ds = datasource_vars[0]
    assert ds["name"] == "DS_PROMETHEUS" and ds["query"] == "prometheus"
    assert ds["hide"] == 0, "the datasource variable is visible: an operator picks the Prometheus to read"
    for panel in query_panels(dashboard):
        assert panel.get("datasource") == DATASOURCE, f"panel {panel['title']!r}"
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, f"a target of {panel['title']!r}"
            assert target.get("expr"), f"an empty target in {panel['title']!r}"
    for variable in variables(dashboard):
        if variable["type"] == "query":
            assert variable.get("datasource") == DATASOURCE, f"variable {variable['name']}"


@pytest.mark.parametrize("name", IDS)
def test_every_panel_has_a_unit_and_a_description(name: str) -> None:
    for panel in query_panels(DASHBOARDS[name]):
        assert panel.get("description", "").strip(), f"panel {panel['title']!r} has no description"
        assert panel.get("fieldConfig", {}).get("defaults", {}).get("unit"), f"panel {panel['title']!r} has no unit"


@pytest.mark.parametrize("name", IDS)
def test_a_stat_strip_on_top_with_thresholds(name: str) -> None:
    dashboard = DASHBOARDS[name]
    top = [p for p in dashboard["panels"] if p["gridPos"]["y"] == 0]
    assert len(top) >= 4 and all(p["type"] == "stat" for p in top), [p["title"] for p in top]
    assert sum(p["gridPos"]["w"] for p in top) == 24, "the strip spans the full width"
    for panel in panels(dashboard):
        if panel["type"] != "stat":
            continue
        steps = panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
        assert len(steps) >= 2 and steps[0]["value"] is None, f"stat {panel['title']!r} needs thresholds"
        values = [s["value"] for s in steps[1:]]
        assert values == sorted(values), f"stat {panel['title']!r}: thresholds out of order"


def _no_overlap(laid_out: list[dict[str, Any]]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in laid_out:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, f"{panel['title']!r} is wider than the grid"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("name", IDS)
def test_panels_have_unique_ids_and_do_not_overlap(name: str) -> None:
    dashboard = DASHBOARDS[name]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    # A collapsed row is one line on the page; its panels are laid out below it only once it is expanded.
    _no_overlap(dashboard["panels"])
    for row in dashboard["panels"]:
        if row.get("collapsed"):
            _no_overlap(row["panels"])
            assert all(p["gridPos"]["y"] > row["gridPos"]["y"] for p in row["panels"]), row["title"]


@pytest.mark.parametrize("name", IDS)
def test_rows_below_the_first_screen_are_collapsed(name: str) -> None:
    rows = [p for p in DASHBOARDS[name]["panels"] if p["type"] == "row"]
    assert rows and not rows[0]["collapsed"], "the first row is the first screen: open"
    assert not rows[0].get("panels"), "an open row holds no panels of its own"
    for row in rows[1:]:
        assert row["collapsed"] and row["panels"], f"row {row['title']!r} is below the first screen: collapse it"


@pytest.mark.parametrize("name", IDS)
def test_up_and_health_open_the_stat_strip(name: str) -> None:
    up, health = DASHBOARDS[name]["panels"][:2]
    assert (up["type"], up["title"], health["title"]) == ("stat", "Up", "Health")
    assert [t["expr"] for t in up["targets"]] == ['up{job=~"$job", instance=~"$instance"}']
    steps = up["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps == [{"color": "red", "value": None}, {"color": "green", "value": 1}], "a target down (0) is red"
    mapped = {k: v["color"] for m in up["fieldConfig"]["defaults"]["mappings"] for k, v in m["options"].items()}
    assert mapped == {"0": "red", "1": "green"}
    assert up["options"]["colorMode"] == "background"
    (expr,) = [t["expr"] for t in health["targets"]]
    assert "conveyor_health_status{" in expr and 'check="overall"' in expr and "by (instance)" in expr
    mapped = {k: v["text"] for m in health["fieldConfig"]["defaults"]["mappings"] for k, v in m["options"].items()}
    assert mapped == {"0": "HEALTHY", "1": "DEGRADED", "2": "UNHEALTHY"}


def _selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, its matchers as written, "" if none) for every series selector of ``expr``."""
    blanked = _STRING_CONTENT.sub(lambda m: '"' + "_" * (len(m.group(0)) - 2) + '"', expr)
    found = []
    for match in _METRIC_AT.finditer(_MATCHER_SPANS.sub(lambda m: "{" + " " * (len(m.group(0)) - 2) + "}", blanked)):
        if match.group(1) not in metric_names(expr) or blanked[match.end() :].lstrip().startswith("("):
            continue
        rest = expr[match.end() :]
        found.append((match.group(1), rest[: rest.index("}") + 1] if rest.startswith("{") else ""))
    return found


@pytest.mark.parametrize("name", IDS)
def test_every_query_filters_on_job_and_instance(name: str) -> None:
    dashboard = DASHBOARDS[name]
    declared = [v["name"] for v in variables(dashboard)]
    assert declared[:3] == ["DS_PROMETHEUS", "job", "instance"], declared
    texts = [(str(q), q.expr) for q in queries(name, dashboard)]
    texts += [
        (f"${v['name']}", label_values_query(variable_query(v))[0])
        for v in variables(dashboard)
        if v["name"] in ("topic", "group", "handler")
    ]
    for where, expr in texts:
        selectors = _selectors(expr)
        assert selectors, where
        for metric, matchers in selectors:
            assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, f"{metric} unfiltered: {where}"


@pytest.mark.parametrize("name", sorted(PER_BROKER))
def test_no_query_adds_brokers_together(name: str) -> None:
    """A parent and its child broker (or any two brokers) are shown apart: every aggregation keeps ``instance``.

    Heatmaps are the exception (one heatmap shows one distribution): choose one instance to read them.
    """
    for query in queries(name, DASHBOARDS[name]):
        if query.heatmap:
            continue
        for match in AGGREGATION.finditer(query.expr):
            assert match.group(2) and "instance" in match.group(2), f"{match.group(0)!r} adds brokers up: {query}"


@pytest.mark.parametrize("name", IDS)
def test_every_rate_uses_rate_interval(name: str) -> None:
    for query in queries(name, DASHBOARDS[name]):
        ranges = re.findall(r"\[([^\]]*)\]", without_strings(query.expr))
        assert all(r == "$__rate_interval" for r in ranges), f"a range other than $__rate_interval: {query}"
        for match in RATE_FUNCTIONS.finditer(query.expr):
            argument = _call_argument(query.expr, match.end() - 1)
            assert argument.endswith("[$__rate_interval]"), f"{match.group(1)}() without $__rate_interval: {query}"


@pytest.mark.parametrize("name", IDS)
def test_latency_histograms_are_heatmaps_of_bucket_rates(name: str) -> None:
    dashboard = DASHBOARDS[name]
    heatmaps = [p for p in query_panels(dashboard) if p["type"] == "heatmap"]
    assert heatmaps, "every dashboard shows at least one latency histogram as a heatmap"
    for panel in heatmaps:
        assert panel["options"]["calculate"] is False, f"{panel['title']!r}: buckets come from Prometheus"
        for target in panel["targets"]:
            assert target.get("format") == "heatmap", f"{panel['title']!r}: format must be heatmap"
            assert HEATMAP_QUERY.match(target["expr"]), f"{panel['title']!r}: {target['expr']}"
    for query in queries(name, dashboard):
        if "_bucket" in query.expr and not query.heatmap:
            assert "histogram_quantile(" in query.expr, f"raw buckets outside a heatmap: {query}"


@pytest.mark.parametrize("name", IDS)
def test_topic_and_group_variables_are_label_values_queries(name: str) -> None:
    declared = {v["name"]: v for v in variables(DASHBOARDS[name])}
    assert "topic" in declared, "every dashboard filters by topic"
    if name not in WITHOUT_GROUPS:
        assert "group" in declared, "group-level dashboards filter by group"
    for variable in declared.values():
        if variable["type"] != "query":
            continue
        selector, label = label_values_query(variable_query(variable))
        assert label == variable["name"], f"${variable['name']} lists the values of {label}"
        assert metric_names(selector) <= exposed_names(), f"${variable['name']}: unknown metric in {selector}"
        assert variable.get("includeAll") and variable.get("allValue") == ".*", f"${variable['name']}: All = .*"


@pytest.mark.parametrize("name", IDS)
def test_every_variable_a_query_uses_is_declared(name: str) -> None:
    dashboard = DASHBOARDS[name]
    declared = {v["name"] for v in variables(dashboard)}
    texts = [q.expr for q in queries(name, dashboard)] + [variable_query(v) for v in variables(dashboard)]
    for text in texts:
        undeclared = variables_used(text) - declared - BUILTIN_VARIABLES
        assert not undeclared, f"undeclared {sorted(undeclared)} in {text}"
    used = set().union(*(variables_used(t) for t in texts))
    unused = declared - used - {"DS_PROMETHEUS"}
    assert not unused, f"declared but never used: {sorted(unused)}"


def test_every_metric_in_every_query_is_registered_by_monitoring() -> None:
    known = exposed_names() | PROMETHEUS_SERIES
    unknown: dict[str, list[str]] = {}
    for query in all_queries():
        names = metric_names(query.expr)
        assert names, f"no metric in {query}"
        for name in names - known:
            unknown.setdefault(name, []).append(str(query))
    assert not unknown, f"metrics no registry exposes: {unknown}"


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (topic, le) (rate(conveyor_x_bucket{topic=~"$topic", le!="1e3"}'
        "[$__rate_interval])))"
        ' / on (instance) group_left (version) conveyor_build_info{component="broker"} and time() - up2 > 1e-3'
    )
    assert metric_names(expr) == {"conveyor_x_bucket", "conveyor_build_info", "up2"}


# --- provisioning ------------------------------------------------------------------------------------------


def _yaml_values(text: str, key: str) -> list[str]:
    return [m.strip().strip("'\"") for m in re.findall(rf"^\s*-?\s*{key}:\s*(\S.*?)\s*(?:#.*)?$", text, re.M)]


def test_provisioned_datasource_uid_is_the_one_dashboards_default_to() -> None:
    text = (GRAFANA / "provisioning" / "datasources" / "conveyor.yml").read_text()
    assert _yaml_values(text, "apiVersion") == ["1"]
    assert _yaml_values(text, "type") == ["prometheus"]
    assert _yaml_values(text, "url") == ["http://localhost:9090"]
    assert _yaml_values(text, "isDefault") in ([], ["false"]), "provisioning must not take over the default datasource"
    (uid,) = _yaml_values(text, "uid")
    for dashboard in DASHBOARDS.values():
        ds: dict[str, Any] = next(v for v in variables(dashboard) if v["name"] == "DS_PROMETHEUS")
        assert ds["current"]["value"] == uid, f"{dashboard['uid']}: provisioned, ${{DS_PROMETHEUS}} must be {uid}"


def test_dashboard_provider_reads_the_dashboards_folder() -> None:
    text = (GRAFANA / "provisioning" / "dashboards" / "conveyor.yml").read_text()
    assert _yaml_values(text, "apiVersion") == ["1"]
    assert _yaml_values(text, "type") == ["file"]
    (path,) = _yaml_values(text, "path")
    assert path.startswith("/") and path.rstrip("/").endswith("dashboards/conveyor"), path
    readme = (GRAFANA / "README.md").read_text()
    assert path in readme, "the README says where to put the dashboards for the provider"
    assert "DS_PROMETHEUS" in readme and "Import" in readme
