"""deploy/grafana/tandem.json: it loads, its panel ids are unique, and every metric its PromQL
names is a series that `tandem serve`'s /metrics really serves: server.metrics.render on a
worker's and a camera service's payloads, parsed back by prometheus_client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tandem.json"
# PromQL words that look like names but are none: functions are dropped by the "(" after them.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges ([5m], [$__rate_interval])
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables
    names = set()
    for m in NAME.finditer(expr):
        rest = expr[m.end() :].lstrip()
        if rest.startswith("(") or m.group() in KEYWORDS:
            continue  # a function, or an aggregation's keyword
        if m.start() > 0 and (expr[m.start() - 1].isdigit() or expr[m.start() - 1] == "."):
            continue  # the exponent or suffix of a number (1e3)
        names.add(m.group())
    return names


def served_series() -> set[str]:
    """Every sample name /metrics serves for one worker (LLM and vision) and one camera service."""
    from prometheus_client.parser import text_string_to_metric_families

    from runtime.metrics import GAUGES, ServingMetrics
    from server.metrics import render

    m = ServingMetrics()
    m.observe_vision_batch(2, [0.01, 0.02])
    m.add("num_preemptions", 1)
    m.finished["stop"] = 3
    snap = m.snapshot(gauges=dict.fromkeys(GAUGES, 1.0))
    worker = {"instance": "w1", "kind": "runtime", "model_name": "m", "metrics": snap}
    camera = {"camera": "cam0", "url": "rtsp://x", "up": True, "fps": 10.0, "frames": 5, "drops": 1}
    cameras = {"instance": "c1", "kind": "cameras", "cameras": [{**camera, "detections": 2, "reconnects": 0}]}
    text = render([worker, cameras]).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def exprs(dashboard: dict) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            q = q.get("query", "")
        if var.get("type") == "query" and isinstance(q, str):
            m = re.fullmatch(r"label_values\(([^,]+),\s*\w+\)", q.strip())
            assert m, f"variable {var['name']}: unexpected query {q!r}"
            found.append(m.group(1))
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_loads_with_unique_panel_ids_and_a_prometheus_variable(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert 36 <= dashboard["schemaVersion"] <= 41
    ds = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds and ds[0]["query"] == "prometheus"
    uid = "${" + ds[0]["name"] + "}"
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == uid, f"panel {p['title']!r} does not use the datasource variable"


def test_every_metric_the_dashboard_reads_is_served(dashboard):
    served = served_series()
    used = {name: e for e in exprs(dashboard) for name in metric_names(e)}
    assert len(used) >= 15, sorted(used)  # the parser found the names (a broken one finds none)
    missing = {n: e for n, e in used.items() if n not in served}
    assert not missing, f"not served by /metrics: {missing}"


def test_the_name_parser_reads_promql():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(tandem:time_to_first_token_seconds_bucket{tandem_instance=~"$i"}'
        "[$__rate_interval]))) / on (x) group_left tandem:num_requests_running + 1e3"
    )
    assert metric_names(expr) == {"tandem:time_to_first_token_seconds_bucket", "tandem:num_requests_running"}
