"""deploy/grafana/dynsnap.json queries only what dynsnap exports: every PromQL expression of every
panel and template variable parses with a PromQL parser (promql-parser, a port of Prometheus's own
grammar: unknown functions, a rate over an instant vector, a bad range are errors), every metric it
selects is one of dynsnap/telemetry/metrics.py's (through family_of, so `_bucket`, `_count` and
`_sum` series count as their histogram) and every label it matches or groups by is one that metric
has. A renamed metric or label fails here, not on somebody's dashboard. It also shows the panels
the dashboard promises (workers per state, capture/wake/verify durations as quantiles over the
histograms' buckets, GPU memory freed, reconciles, queue depth)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import promql_parser as pq
import pytest

from dynsnap.telemetry.metrics import METRIC_NAMES, METRICS, family_of

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dynsnap.json"
SPECS = {m.name: m for m in METRICS}
# Labels Prometheus adds to every scraped series; `le` is a histogram bucket's.
TARGET_LABELS = ("job", "instance")

# Grafana's variables, replaced by a value of their kind before parsing (what Grafana does at query time).
DURATIONS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "6h"}


def _load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels") or []  # panels of a collapsed row
    return out


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (label_values(SELECTOR, label))."""
    found = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in _panels(dash) for t in p.get("targets") or []]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_]+)\)", v["query"]["query"])
            assert m, f"variable {v['name']}: only label_values(SELECTOR, LABEL) queries are checked"
            found.append((f"variable {v['name']!r}", m.group(1)))
    return found


def _expand(expr: str) -> str:
    for var, value in DURATIONS.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?[A-Za-z_]+\}?", "var", expr)  # job=~"$controller" -> job=~"var"


def problems(expr: str) -> list[str]:
    """What is wrong with one query: a parse error, a series dynsnap does not export, a label its metric
    does not have (matched, or grouped by)."""
    try:
        ast = pq.parse(_expand(expr))
    except ValueError as e:
        return [f"does not parse: {e}"]
    errors: list[str] = []
    labels_in_scope: set[str] = set(TARGET_LABELS)
    aggregations: list[Any] = []

    def visit(node: Any) -> bool:
        if isinstance(node, pq.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            family = family_of(name) if name else None
            if family is None:
                errors.append(f"selects {name!r}, which dynsnap does not export")
                return True
            allowed = {*SPECS[family].labels, *TARGET_LABELS, *(("le",) if name.endswith("_bucket") else ())}
            labels_in_scope.update(allowed)
            for m in node.matchers.matchers:
                if m.name not in allowed and m.name != "__name__":
                    errors.append(f"matches label {m.name!r}, which {family} does not have")
        if isinstance(node, pq.AggregateExpr) and node.modifier is not None:
            aggregations.append(node)
        return True

    pq.walk(ast, visit)
    for agg in aggregations:  # checked once every selector's labels are known
        for label in agg.modifier.labels:
            if label not in labels_in_scope:
                errors.append(f"groups by {label!r}, which none of its metrics has")
    return errors


def test_every_query_parses_and_uses_only_exported_metrics_and_labels() -> None:
    found = queries(_load())
    assert len(found) >= 20
    bad = {where: p for where, expr in found if (p := problems(expr))}
    assert not bad, json.dumps(bad, indent=2)


@pytest.mark.parametrize(("expr", "error"), [
    ("max(dynsnap_worker{state=\"Suspended\"})", "selects 'dynsnap_worker', which dynsnap does not export"),
    ("max by (state) (dynsnap_workers{status=\"Suspended\"})", "matches label 'status'"),
    ("sum by (phase) (dynsnap_workers)", "groups by 'phase'"),
    ("rate(dynsnap_reconciles_total)", "does not parse"),
    ("histogram_quantile(0.5, sum by (le) (rate(dynsnap_capture_duration_seconds_bucket[5m]))",
     "does not parse: unclosed left parenthesis"),
    ("histogrm_quantile(0.5, dynsnap_capture_duration_seconds_bucket)", "does not parse"),
    ("sum(rate(dynsnap_capture_seconds_bucket[$__rate_interval]))", "dynsnap_capture_seconds_bucket"),
])
def test_the_check_catches_a_wrong_query(expr: str, error: str) -> None:
    assert any(error in p for p in problems(expr)), problems(expr)


def test_a_renamed_metric_fails_the_check() -> None:
    dash = _load()
    renamed = copy.deepcopy(dash)
    text = json.dumps(renamed).replace("dynsnap_gpu_bytes_freed", "dynsnap_gpu_freed_bytes")
    bad = [w for w, e in queries(json.loads(text)) if problems(e)]
    assert bad and all("GPU memory freed" in w for w in bad), bad


def _used(dash: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for _, expr in queries(dash):
        pq.walk(pq.parse(_expand(expr)), lambda n: names.add(n.name) if isinstance(n, pq.VectorSelector) else None)
    return names


def test_the_dashboard_shows_what_it_promises() -> None:
    dash = _load()
    used = _used(dash)
    families = {family_of(n) for n in used}
    assert {"dynsnap_workers", "dynsnap_gpu_bytes_freed", "dynsnap_reconciles_total", "dynsnap_queue_depth",
            "dynsnap_capture_duration_seconds", "dynsnap_wake_duration_seconds",
            "dynsnap_verify_duration_seconds"} <= families
    assert families <= METRIC_NAMES
    exprs = [e for _, e in queries(dash)]
    for hist in ("dynsnap_capture_duration_seconds", "dynsnap_wake_duration_seconds",
                 "dynsnap_verify_duration_seconds"):
        quantiles = [e for e in exprs if hist + "_bucket" in e]
        assert quantiles and all(e.startswith("histogram_quantile(") and "by (le," in e for e in quantiles), hist
    assert any("by (state)" in e and "dynsnap_workers" in e for e in exprs)


def test_the_dashboard_is_importable() -> None:
    dash = _load()
    assert dash["uid"] == "dynsnap" and isinstance(dash["schemaVersion"], int) and dash["title"]
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in _panels(dash):
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"] and p["description"], p["title"]
    # every variable a query names exists
    for where, expr in queries(dash):
        for var in re.findall(r"\$\{?([A-Za-z_]+)\}?", expr):
            assert var.startswith("__") or var in variables, (where, var)


def test_every_selected_series_is_in_what_a_process_really_serves() -> None:
    """Against the exposition text itself: a Metrics that saw one of each event, rendered as /metrics
    serves it, parsed with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from dynsnap.telemetry.metrics import Metrics

    m = Metrics()
    m.reconciled("controller", "done")
    m.set_queue_depth("controller", 2)
    m.operation_finished("capture", "snapshot", ok=True, seconds=3.0)
    m.operation_finished("wake", "snapshot", ok=True, seconds=2.0)
    m.operation_finished("wake", "snapshot", ok=False, seconds=None)
    m.observe_verify("verified", 0.7)
    m.frontend_scrape("ok")
    m.api_request("get")
    m.set_workers({"Suspended": 1})
    m.set_gpu_bytes_freed(2**30)
    served: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(m.render()):
        for s in fam.samples:
            served.setdefault(s.name, set()).update(s.labels)
    for where, expr in queries(_load()):
        def visit(node: Any, where: str = where) -> None:
            if isinstance(node, pq.VectorSelector):
                assert node.name in served, (where, node.name)
                extra = {x.name for x in node.matchers.matchers} - served[node.name] - set(TARGET_LABELS)
                assert not extra, (where, node.name, extra)
        pq.walk(pq.parse(_expand(expr)), visit)
