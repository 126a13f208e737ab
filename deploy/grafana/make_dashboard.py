"""Writes kvpool.json, the Grafana dashboard over the daemon's and the engines' metrics
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
