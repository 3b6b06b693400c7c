"""deploy/grafana/: the dashboard queries only metrics the code exports."""

from __future__ import annotations

import ast
import json
import re

import yaml

from tests.support import ROOT


def exported_metrics() -> set[str]:
    """Series names the code exports, from its prometheus_client constructors."""
    suffixes = {"Counter": ["_total", "_created"], "Gauge": [""], "Histogram": ["_bucket", "_sum", "_count"]}
    suffixes["Summary"] = ["_sum", "_count"]
    out = set()
    for path in list((ROOT / "shared").rglob("*.py")) + list((ROOT / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in suffixes and node.args:
                name = node.args[0]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    base = name.value.removesuffix("_total")
                    out |= {base + s for s in suffixes[node.func.id]}
    return out


def test_grafana_dashboard_uses_exported_metrics() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "burstrl-dashboard.json").read_text())
    exported = exported_metrics()
    assert "burstrl_ready" in exported and "burstrl_rollout_tokens_total" in exported
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs and dash["uid"] and dash["title"]
    used = {m for e in exprs for m in re.findall(r"\b(burstrl_[a-z0-9_]+)\b", e)}
    assert used, "the dashboard queries no burstrl metric"
    assert used <= exported, f"not exported by the code: {sorted(used - exported)}"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", "data source must be the dashboard variable"
    scrape = yaml.safe_load((ROOT / "deploy" / "grafana" / "prometheus.yml").read_text())
    assert all(j["job_name"].startswith("burstrl") for j in scrape["scrape_configs"])  # `up{job=~"burstrl.*"}`
