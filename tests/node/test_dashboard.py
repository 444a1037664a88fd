"""The Grafana dashboard (``docs/grafana/kvcr.json``) cannot drift from the code.

It imports as is (a Prometheus data source input, an ``instance`` variable), every panel
queries something, and every metric name in its queries is one a node exports (the
families of ``kvcr_node.metrics_text``, rendered from a real node's snapshot, histograms
with their ``_bucket``, ``_sum`` and ``_count``) or one the vLLM connector does
(``vllm:kvcr_<counter>_total`` for each of ``vllm_common.COUNTERS``, read from its source,
since importing it needs vLLM).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from kvcr_node.config import NodeConfig
from kvcr_node.metrics_text import Dropped, render, render_exporter
from kvcr_node.poolspec import PoolSpec
from kvcr_testing.nodes import node_driver

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "kvcr.json"
VLLM_COMMON = ROOT / "kvcr_client" / "integrations" / "vllm_common.py"
METRIC = re.compile(r"(?<![\w:])((?:vllm:)?kvcr_[a-z0-9_]+)")
"""A kvcr metric name in a PromQL expression."""
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def metric_names(expr: str) -> list[str]:
    """The kvcr metric names a PromQL expression reads (quoted label values left out)."""
    return METRIC.findall(QUOTED.sub('""', expr))


def node_names(ipc_dir: Path) -> set[str]:
    """Every sample name a node's exporter serves."""
    config = NodeConfig(endpoint=f"ipc://{ipc_dir}/dash.sock", name="dash", log_level="WARNING",
                        pools=(PoolSpec("kv", 4096, 4, "dram"),), metrics_port=0).validated()
    with node_driver(config) as d:
        publisher = d.node.publisher
        assert publisher is not None
        publisher.publish()
        assert publisher.latest is not None
        text = render(publisher.latest) + render_exporter(0, dict.fromkeys(Dropped, 0))
    names = set()
    for line in text.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def connector_names() -> set[str]:
    tree = ast.parse(VLLM_COMMON.read_text())
    [counters] = [n.value for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "COUNTERS"]
    assert counters is not None
    return {f"vllm:kvcr_{name}_total" for name in ast.literal_eval(counters)}


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", ())]


def test_the_dashboard_imports_and_every_panel_queries_something() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["pluginId"] for i in dashboard["__inputs"]] == ["prometheus"]
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["instance"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(graphs) >= 15
    for panel in graphs:
        assert panel["targets"] and all(metric_names(t["expr"]) for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_every_metric_the_dashboard_queries_is_exported(ipc_dir: Path) -> None:
    exported = node_names(ipc_dir) | connector_names()
    assert "kvcr_pool_used_bytes" in exported and "vllm:kvcr_blocks_loaded_total" in exported
    dashboard = json.loads(DASHBOARD.read_text())
    used = {(title, name) for title, expr in queries(dashboard) for name in metric_names(expr)}
    used |= {("variable instance", name) for v in dashboard["templating"]["list"]
             for name in metric_names(v["definition"])}
    missing = sorted((title, name) for title, name in used if name not in exported)
    assert missing == [], missing
    # What the dashboard shows covers the areas an operator watches.
    shown = {name for _, name in used}
    for wanted in ("kvcr_pool_used_bytes", "kvcr_query_hits_total", "kvcr_delivered_bytes_total",
                   "kvcr_deposited_bytes_total", "kvcr_request_duration_seconds_bucket", "kvcr_leases",
                   "kvcr_evictions_total", "kvcr_operation_failures_total", "kvcr_peer_links",
                   "vllm:kvcr_blocks_loaded_total"):
        assert wanted in shown, wanted


def test_a_name_the_code_does_not_export_is_caught() -> None:
    """The check reads names out of PromQL as written: a misspelt one is found, labels are not."""
    expr = 'sum by (pool) (rate(kvcr_pool_used_byte{instance=~"kvcr_x"}[5m])) / vllm:kvcr_loads_total'
    assert metric_names(expr) == ["kvcr_pool_used_byte", "vllm:kvcr_loads_total"]
