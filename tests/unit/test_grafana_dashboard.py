"""deploy/grafana-dashboard.json: every metric its queries (and its model variable) name is one the
server exports on /metrics (rendered by the same code), under the name and type it has there."""
from __future__ import annotations

import json
import re
from pathlib import Path

from moe_serve.metrics import EngineMetrics
from moe_serve.protocol import EngineStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


def test_every_dashboard_query_names_an_exported_metric():
    exposition = EngineMetrics().render("m", EngineStats())
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M))
    series = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", exposition, re.M))
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    named = {n for e in exprs for n in re.findall(r"moe_serve:[a-z0-9_]+", e)}
    assert len(named) >= 10  # the dashboard covers throughput, latency, KV, prefix hits, EP balance, EPLB
    for name in named:
        assert name in series, name  # the exact series: a histogram is read through its _bucket series
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name.endswith("_bucket"):
            assert types[base] == "histogram", name
        elif name.endswith("_total"):
            assert types[name] == "counter", name
        else:
            assert types[name] == "gauge", name
    labels: dict[str, set] = {}  # each series' label names, as exported
    for name, lab in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", exposition, re.M):
        labels.setdefault(name, set()).update(re.findall(r'(\w+)="', lab))
    for p in dash["panels"]:  # a legend's {{label}} is one its series carry
        for t in p["targets"]:
            for lab in re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")):
                assert all(lab in labels[n] for n in re.findall(r"moe_serve:[a-z0-9_]+", t["expr"])), (p["title"], lab)
    for e in exprs:  # rates and quantiles only over counters and histogram buckets
        for fn, arg in re.findall(r"(rate|increase)\((moe_serve:[a-z0-9_]+)", e):
            assert arg.endswith(("_total", "_bucket")), e
        assert "histogram_quantile" not in e or "_bucket" in e, e
