"""Read the shipped Grafana dashboards: panels, queries, variables and the metric names queries use."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# Grafana's own variables: substituted by Grafana, never declared in a dashboard.
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBERS = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
# A variable's name starts with a letter or "_": ``$1`` in a ``label_replace`` is PromQL's, which Grafana leaves
# as it is (it names no variable).
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?::\w+)?\}|([A-Za-z_]\w*))")
_LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?(\w+)\)$")


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    expr: str
    heatmap: bool = False

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel}: {self.expr}"


def load_dashboards() -> dict[str, dict[str, Any]]:
    """File name -> parsed dashboard, for every JSON file under grafana/dashboards/."""
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def query_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Panels that show data (rows only group them)."""
    return (p for p in panels(dashboard) if p.get("type") != "row")


def variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return list(dashboard.get("templating", {}).get("list", []))


def listed_values(variable: dict[str, Any], values: list[str]) -> list[str]:
    """The values a query variable offers, as Grafana filters them by its ``regex`` (``/.../``, if any)."""
    pattern = str(variable.get("regex") or "")
    if not pattern:
        return values
    body = re.fullmatch(r"/(.*)/", pattern)
    assert body is not None, f"${variable['name']}: regex {pattern!r} is not /.../"
    return [value for value in values if re.search(body.group(1), value)]


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    return str(query.get("query", "") if isinstance(query, dict) else query)


def queries(name: str, dashboard: dict[str, Any]) -> Iterator[Query]:
    for panel in query_panels(dashboard):
        for target in panel.get("targets", []):
            yield Query(name, panel.get("title", "?"), target["expr"], panel.get("type") == "heatmap")


def all_queries() -> list[Query]:
    return [q for name, dashboard in load_dashboards().items() for q in queries(name, dashboard)]


def variables_used(text: str) -> set[str]:
    return {a or b for a, b in _VARIABLE.findall(text)}


def without_strings(expr: str) -> str:
    """``expr`` with every string literal emptied (a regex matcher's ``[0-9]`` is no range)."""
    return _STRING.sub('""', expr)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, label names or durations)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    text = _NUMBERS.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name = match.group(0)
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if name.lower() not in PROMQL_KEYWORDS:
            names.add(name)
    return names


def label_values_query(query: str) -> tuple[str, str]:
    """``label_values(metric{...}, label)`` -> (series selector, label)."""
    match = _LABEL_VALUES.match(query.strip())
    if match is None:
        raise ValueError(f"not a label_values() query: {query}")
    return match.group(1) or "", match.group(2)


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace ``$name`` and ``${name}`` the way Grafana would, with one value per variable."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {text}")
        return values[name]

    return _VARIABLE.sub(one, text)
