"""Writes kvpool.json, the Grafana dashboard over the daemon's, the engines' and the
fleet router's metrics
(``python deploy/grafana/make_dashboard.py``; the JSON is committed, import it in Grafana:
Dashboards -> New -> Import, pick the Prometheus data source)."""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


def target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}


def panel(pid: int, title: str, grid: tuple[int, int, int, int], unit: str, targets: list,
          stack: bool = False, overrides: list | None = None, description: str = "") -> dict:
    x, y, w, h = grid
    return {
        "id": pid, "type": "timeseries", "title": title, "description": description,
        "datasource": DS, "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": {
                "drawStyle": "line", "lineWidth": 1, "fillOpacity": 60 if stack else 10,
                "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                "showPoints": "never"}},
            "overrides": overrides or []},
        "options": {"legend": {"displayMode": "table", "placement": "right",
                               "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [target(e, lg, chr(65 + i)) for i, (e, lg) in enumerate(targets)],
    }


def row(pid: int, title: str, y: int) -> dict:
    """A row header across the dashboard at height ``y`` (the panels below it follow)."""
    return {"id": pid, "type": "row", "title": title, "collapsed": False,
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []}


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))",
             f"{legend}p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


BUDGET_LINE = [{"matcher": {"id": "byName", "options": "budget"}, "properties": [
    {"id": "custom.stacking", "value": {"mode": "none", "group": "budget"}},
    {"id": "custom.fillOpacity", "value": 0},
    {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
    {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}]


def fleet_row(y: int) -> list[dict]:
    """``kvpool fleet``'s router (its /metrics, names in docs/ARCHITECTURE.md "Fleet"):
    traffic per model and replica, queues, sleep and wake, failures, and how requests
    were routed among replicas next to the engines' prefix-cache hit rate."""
    by_model = "sum by (model)"
    return [
        row(11, "Fleet", y),
        panel(12, "Fleet: requests by model and replica", (0, y + 1, 8, 8), "reqps", [
            (f"sum by (model, replica) (rate(kvpool_fleet_requests_total[{RATE}]))",
             "{{model}}/{{replica}}"),
            (f'sum by (model, code) (rate(kvpool_fleet_requests_total{{code!~"2.."}}'
             f"[{RATE}]))", "{{model}} HTTP {{code}}")],
              description="Requests the fleet answered, per replica; and those answered "
              "with an error code (429: the model's queue was full)."),
        panel(13, "Fleet: queued and in flight", (8, y + 1, 8, 8), "short", [
            (f"{by_model} (kvpool_fleet_queue_depth)", "{{model}} queued"),
            ("sum by (model, replica) (kvpool_fleet_inflight)",
             "{{model}}/{{replica}} in flight")],
              description="Queued: requests waiting for a ready server (bounded per model)."),
        panel(14, "Fleet: replicas by state", (16, y + 1, 8, 8), "short", [
            ("sum by (model, state) (kvpool_fleet_replica_up)", "{{model}} {{state}}")],
              stack=True),
        panel(15, "Fleet: wake time (request to ready)", (0, y + 9, 8, 8), "s",
              quantiles("kvpool_fleet_wake_seconds", "model")),
        panel(16, "Fleet: wakes and sleeps", (8, y + 9, 8, 8), "ops", [
            (f"{by_model} (rate(kvpool_fleet_wakes_total[{RATE}]))", "{{model}} wakes"),
            (f"sum by (model, cause) (rate(kvpool_fleet_sleeps_total[{RATE}]))",
             "{{model}} sleeps: {{cause}}")],
              description="Sleep causes: idle (sleep_after), pressure (the daemon made room), "
              "operator (kvpool sleep)."),
        panel(17, "Fleet: upstream errors and restarts", (16, y + 9, 8, 8), "ops", [
            (f"sum by (model, kind) (rate(kvpool_fleet_upstream_errors_total[{RATE}]))",
             "{{model}} {{kind}}"),
            (f"{by_model} (rate(kvpool_fleet_restarts_total[{RATE}]))", "{{model}} restarts")]),
        panel(18, "Fleet: routing among replicas, by reason", (0, y + 17, 12, 8), "reqps", [
            (f"sum by (model, reason) (rate(kvpool_fleet_routed_total[{RATE}]))",
             "{{model}} {{reason}}")],
              description="prefix (a prefix hit): sent where its prompt's prefix went "
              "before; load: the "
              "least loaded (no holder, or the holder was busy); only: one ready replica; "
              "turn: round-robin."),
        panel(19, "Prefix routing share and engine prefix-cache hit rate", (12, y + 17, 12, 8),
              "percentunit", [
                  (f'{by_model} (rate(kvpool_fleet_routed_total{{reason="prefix"}}[{RATE}]))'
                   f" / {by_model} (rate(kvpool_fleet_routed_total[{RATE}]))",
                   "{{model}} routed by prefix"),
                  (f"sum by (model_name) (rate(vllm:prefix_cache_hits_total[{RATE}])) / "
                   f"sum by (model_name) (rate(vllm:prefix_cache_queries_total[{RATE}]))",
                   "{{model_name}} engine hit rate")],
              description="The engines' share of prompt tokens found in their prefix cache: "
              "what prefix routing is for."),
    ]


def dashboard() -> dict:
    panels = [
        panel(1, "Memory per tenant (mapped + leased) against the budget", (0, 0, 16, 9),
              "bytes", [
                  ("sum by (tenant) (kvpool_tenant_mapped_bytes + kvpool_tenant_lease_bytes)",
                   "{{tenant}}"),
                  ("sum(kvpool_pool_budget_bytes)", "budget")],
              stack=True, overrides=BUDGET_LINE,
              description="Stacked: what each tenant holds; dashed: the daemon's budget."),
        panel(2, "Pool", (16, 0, 8, 9), "bytes", [
            ("sum(kvpool_pool_warm_bytes)", "warm"), ("sum(kvpool_pool_dirty_bytes)", "dirty"),
            ("sum(kvpool_pool_free_bytes)", "free"), ("sum(kvpool_pool_leased_bytes)", "leased"),
            ("sum(kvpool_pool_waiting_bytes)", "waiting for reclaim")]),
        panel(3, "Grant wait (requests that waited for reclaim)", (0, 9, 8, 8), "s",
              quantiles("kvpool_grant_wait_seconds")),
        panel(4, "Reclaim round duration", (8, 9, 8, 8), "s",
              quantiles("kvpool_reclaim_round_seconds")),
        panel(5, "Grant service time in the daemon", (16, 9, 8, 8), "s",
              quantiles("kvpool_grant_service_seconds")),
        panel(6, "NO_MEMORY and OVER_LIMIT answers", (0, 17, 8, 8), "reqps", [
            (f'sum(rate(kvpool_answers_total{{code="NO_MEMORY"}}[{RATE}]))', "NO_MEMORY"),
            (f'sum(rate(kvpool_answers_total{{code="OVER_LIMIT"}}[{RATE}]))', "OVER_LIMIT"),
            (f"sum(rate(kvpool_hostile_refused_total[{RATE}]))", "refused (malformed)")]),
        panel(7, "Bytes reclaimed per tenant", (8, 17, 8, 8), "Bps", [
            (f"sum by (tenant, mode) (rate(kvpool_reclaimed_bytes_total[{RATE}]))",
             "{{tenant}} {{mode}}")]),
        panel(8, "Grants, waits and reclaim rounds", (16, 17, 8, 8), "ops", [
            (f"sum(rate(kvpool_grants_total[{RATE}]))", "grants"),
            (f"sum(rate(kvpool_waits_total[{RATE}]))", "waits"),
            (f"sum by (stage) (rate(kvpool_reclaim_rounds_by_stage_total[{RATE}]))",
             "rounds: {{stage}}"),
            (f"sum(rate(kvpool_tenant_departures_total{{how=\"death\"}}[{RATE}]))",
             "tenant deaths")]),
        panel(9, "Engines: time to first token", (0, 25, 12, 8), "s",
              quantiles("vllm:time_to_first_token_seconds", "model_name")),
        panel(10, "Engines: requests running / waiting, KV usage", (12, 25, 12, 8), "short", [
            ("sum by (model_name) (vllm:num_requests_running)", "{{model_name}} running"),
            ("sum by (model_name) (vllm:num_requests_waiting)", "{{model_name}} waiting"),
            (f"sum by (model_name) (rate(vllm:num_preemptions_total[{RATE}]))",
             "{{model_name}} preemptions/s")]),
        *fleet_row(33),
    ]
    return {
        "title": "kvpool", "uid": "kvpool", "schemaVersion": 39, "version": 1,
        "tags": ["kvpool", "gpu-memory"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    # the Helm chart carries its own copy (Helm reads no file outside the chart);
    # tests/deploy checks the two are equal
    here = Path(__file__).resolve().parent
    text = json.dumps(dashboard(), indent=2) + "\n"
    for out in (here / "kvpool.json", here.parent / "helm" / "kvpool" / "dashboards" / "kvpool.json"):
        out.write_text(text)
        print(f"wrote {out}")
