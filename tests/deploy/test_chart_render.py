"""The chart lints clean (strict), renders with the default values and every example
values file, and every rendered object is valid for two Kubernetes versions (DRA
objects and pods with claims: for every version from 1.35, resource.k8s.io/v1's GA) and
reads back through kubectl without a server. Custom resources of the Prometheus
operator, which no Kubernetes schema knows, are checked against what they must select
(the inference gateway's: test_chart_gateway.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .chart import (CHART, CRD_KINDS, DRA_KUBE_VERSIONS, EXAMPLES, NAMESPACE, REPO, Obj,
                    helm_python, one, render, uses_dra, values_of)

kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="kubernetes-validate (the `test` extra)")

KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest minor the chart is checked on
CASES = [None, *EXAMPLES]
IDS = ["defaults", *(p.stem for p in EXAMPLES)]


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_lint_strict_clean(values: Path | None) -> None:
    out = helm_python.lint(str(CHART), values_of(values), strict=True, namespace=NAMESPACE)
    assert out["errors"] == []
    # severity 1 is INFO ("icon is recommended": the project has no icon to point at)
    loud = [m for m in out["messages"] if m["severity"] > 1]
    assert loud == [], loud


def test_examples_exist_for_each_tenant_mode_and_monitor() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"vllm", "bundled-server", "training-job", "prometheus-operator", "dra-shared",
            "dra-consumable", "inference-gateway"} <= names
    kinds = {p.stem: {o["kind"] for o in render(values_of(p))} for p in EXAMPLES}
    assert "Deployment" in kinds["vllm"] and "Job" in kinds["training-job"]
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds["prometheus-operator"]
    assert "ResourceClaim" in kinds["dra-shared"]
    assert "ResourceClaimTemplate" in kinds["dra-consumable"]
    assert {"InferencePool", "HTTPRoute"} <= kinds["inference-gateway"]


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_every_object_valid_for_two_kubernetes_versions(values: Path | None) -> None:
    objs = render(values_of(values))
    assert {"DaemonSet", "ConfigMap"} <= {o["kind"] for o in objs}
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue  # no schema: test_monitors_select_the_daemon, test_chart_gateway
        for version in DRA_KUBE_VERSIONS if uses_dra(obj) else KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{obj['kind']} {obj['metadata']['name']} invalid for "
                            f"Kubernetes {version}: {e.message}")


def test_validation_is_strict() -> None:
    """The validator rejects an unknown field (so a typo in a template would fail)."""
    objs = render()
    ds = one(objs, "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["runAsUsr"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE_VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_reads_every_object_without_a_server(tmp_path: Path) -> None:
    """`kubectl apply --dry-run=client` needs a server for its discovery, so the check is
    `kubectl label --local --dry-run=client`: kubectl decodes each object into its typed
    form offline (a wrongly typed field fails) and names it."""
    objs = [o for p in CASES for o in render(values_of(p))]
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all(objs))
    out = subprocess.run(["kubectl", "label", "--local", "--dry-run=client", "-f", str(path),
                          "-o", "name", "checked=yes"], capture_output=True, text=True,
                         timeout=60, env={"KUBECONFIG": "/dev/null", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == len(objs)


def test_monitors_select_the_daemon() -> None:
    """ServiceMonitor → the metrics Service → the daemon pods' metrics port; PodMonitor →
    the daemon pods; the three alerts; the dashboard
    ConfigMap is deploy/grafana/kvpool.json."""
    values = values_of(CHART / "examples" / "prometheus-operator.yaml")
    objs = render(values)
    pod_objs = render({**values, "metrics": {**values["metrics"], "podMonitor": {"enabled": True}}})
    ds = one(objs, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"]
             for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]}
    svc = one(objs, "Service", "-metrics")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    sm = one(objs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} == {svc["spec"]["ports"][0]["name"]}
    pm = one(pod_objs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= set(ports)
    rules = one(objs, "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"KvpoolDaemonDown", "KvpoolPoolExhausted",
                                           "KvpoolReclaimIgnored"}
    for r in rules:  # (their metric names are checked against a real daemon's: test_chart_daemon)
        assert r["for"] and r["labels"]["severity"] and r["expr"]
    dash = one(objs, "ConfigMap", "-dashboard")
    committed = json.loads((REPO / "deploy" / "grafana" / "kvpool.json").read_text())
    assert json.loads(dash["data"]["kvpool.json"]) == committed
