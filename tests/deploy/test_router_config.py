"""deploy/router/endpoint-picker.yaml names only metrics a kvpool endpoint exports (the
protocol tables of tests/observability/test_router_protocol.py and
tests/fleet/test_fleet_endpoints.py), maps the router's standard fields to the names
with the meanings it assumes, and its scorers read attributes it defines."""

from __future__ import annotations

from pathlib import Path

import yaml

from fleet.test_fleet_endpoints import PROTOCOL as FLEET
from observability.test_router_protocol import PROTOCOL as SERVER

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "router" / "endpoint-picker.yaml"


def strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def test_the_router_config_names_what_kvpool_exports() -> None:
    doc = yaml.safe_load(CONFIG.read_text())
    (engine,) = doc["engineConfigs"]
    assert engine["name"] == "kvpool"
    assert engine["queuedRequestsMetric"] == "vllm:num_requests_waiting"
    assert engine["runningRequestsMetric"] == "vllm:num_requests_running"
    assert engine["kvCacheUsagePercentageMetric"] == "vllm:kv_cache_usage_perc"
    assert engine["cacheInfoMetric"] == "vllm:cache_config_info"
    named = [s for s in strings(doc) if s.startswith(("vllm:", "kvpool:"))]
    assert named and all(n in SERVER for n in named), [n for n in named if n not in SERVER]
    custom = {c["name"]: c["metric"] for c in engine["customMetrics"]}
    read = [p["parameters"]["attribute"] for p in doc["plugins"]
            if p["type"] == "attribute-scorer"]
    assert read and all(a in custom for a in read)
    shared = {"vllm:num_requests_waiting", "vllm:num_requests_running",
              "vllm:kv_cache_usage_perc", "vllm:cache_config_info", "kvpool:asleep",
              "kvpool:pool_free_bytes"}
    assert shared <= set(FLEET) and shared <= set(SERVER)  # a fleet speaks them too
    refs = {p["pluginRef"] for prof in doc["schedulingProfiles"] for p in prof["plugins"]}
    assert refs == {p.get("name", p["type"]) for p in doc["plugins"]}
