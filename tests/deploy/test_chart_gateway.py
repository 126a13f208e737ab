"""The cluster router in front of the vLLM tenants (examples/inference-gateway.yaml,
docs/KUBERNETES.md "A fleet behind a Gateway"): an InferencePool
(inference.networking.k8s.io/v1), an HTTPRoute (gateway.networking.k8s.io/v1) and the
endpoint picker's configuration. kubernetes-validate has no schema for either API group
(they are CRDs), so their structure is checked here against the fields of the released
CRDs (Gateway API Inference Extension v1.0, Gateway API v1), explicitly: no unknown field,
the required ones present, ports in range; and what they must select: the pool selects
the vLLM pods and their serving port, the route leads to the pool, the picker's profile
names only plugins it declares. Every other rendered object of the example is validated
by test_chart_render.py (1.30/1.37, DRA objects 1.35-1.37)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .chart import CHART, NAMESPACE, Obj, broken_chart, one, pod_specs, render, values_of

VALUES = values_of(CHART / "examples" / "inference-gateway.yaml")

# the fields of the released CRDs (InferencePool v1 of the inference extension v1.0.x;
# HTTPRoute v1 of the Gateway API), as far as the chart writes them
POOL_SPEC = {"selector": {"matchLabels"}, "targetPorts": {"number"},
             "endpointPickerRef": {"group", "kind", "name", "port", "failureMode"}}
POOL_REQUIRED = {"selector", "targetPorts", "endpointPickerRef"}
ROUTE_PARENT = {"group", "kind", "namespace", "name", "sectionName", "port"}
ROUTE_RULE = {"name", "matches", "filters", "backendRefs", "timeouts", "retry",
              "sessionPersistence"}
ROUTE_MATCH = {"path", "headers", "queryParams", "method"}
ROUTE_BACKEND = {"group", "kind", "name", "namespace", "port", "weight", "filters"}
META = {"name", "namespace", "labels", "annotations"}


def check_pool_structure(pool: Obj) -> None:
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert set(pool) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(pool["metadata"]) <= META
    spec = pool["spec"]
    assert set(spec) <= set(POOL_SPEC) and POOL_REQUIRED <= set(spec), set(spec)
    assert set(spec["selector"]) == {"matchLabels"}
    assert all(isinstance(v, str) for v in spec["selector"]["matchLabels"].values())
    (port,) = spec["targetPorts"]  # the CRD allows exactly one
    assert set(port) == {"number"} and 1 <= port["number"] <= 65535
    ref = spec["endpointPickerRef"]
    assert set(ref) <= POOL_SPEC["endpointPickerRef"] and ref["name"], ref
    assert set(ref["port"]) == {"number"} and 1 <= ref["port"]["number"] <= 65535
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def check_route_structure(route: Obj) -> None:
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert set(route) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(route["metadata"]) <= META
    assert set(route["spec"]) <= {"parentRefs", "hostnames", "rules"}
    for parent in route["spec"]["parentRefs"]:
        assert set(parent) <= ROUTE_PARENT and parent["name"], parent
    for rule in route["spec"]["rules"]:
        assert set(rule) <= ROUTE_RULE, rule
        for match in rule.get("matches", []):
            assert set(match) <= ROUTE_MATCH, match
            path = match.get("path", {})
            assert set(path) <= {"type", "value"}
            assert path.get("type", "PathPrefix") in ("Exact", "PathPrefix",
                                                       "RegularExpression")
            assert str(path.get("value", "/")).startswith("/")
        for backend in rule["backendRefs"]:
            assert set(backend) <= ROUTE_BACKEND and backend["name"], backend


def check_pool_selects_the_servers(objs: list[Obj]) -> None:
    """The pool's selector picks the vLLM pods (and no daemon), its port is their serving
    port; the route's one backend is the pool, in the pool's namespace."""
    pool = one(objs, "InferencePool")
    check_pool_structure(pool)
    labels = pool["spec"]["selector"]["matchLabels"]
    selected = []
    for obj, spec in pod_specs(objs, ("Deployment", "Job", "DaemonSet")):
        pod_labels = obj["spec"]["template"]["metadata"]["labels"]
        if labels.items() <= pod_labels.items():
            selected.append(obj["metadata"]["name"])
            ports = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
            assert pool["spec"]["targetPorts"][0]["number"] in ports, (obj["metadata"]["name"],
                                                                      ports)
    assert selected == ["kvpool-vllm"], f"the pool selects {selected}"
    route = one(objs, "HTTPRoute")
    check_route_structure(route)
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert backend.get("namespace", NAMESPACE) == pool["metadata"].get("namespace", NAMESPACE)


def picker_config(objs: list[Obj]) -> dict[str, Any]:
    return yaml.safe_load(one(objs, "ConfigMap", "-endpoint-picker")["data"]["config.yaml"])


def test_the_example_fleet_routes_to_its_servers() -> None:
    objs = render(VALUES)
    check_pool_selects_the_servers(objs)
    pool, route = one(objs, "InferencePool"), one(objs, "HTTPRoute")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref == {"name": "kvpool-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io",
                                            "kind": "Gateway", "name": "inference-gateway",
                                            "namespace": "gateway"}]
    # the fleet: four replicas, never two on one node (one session per name per daemon)
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] == 4
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()
    # the Gateway's data plane and the picker reach the servers' port
    np = one(objs, "NetworkPolicy", "-tenants")
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}} \
        in np["spec"]["ingress"][0]["from"]


def test_the_picker_config_names_only_its_plugins() -> None:
    cfg = picker_config(render(VALUES))
    assert cfg["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert cfg["kind"] == "EndpointPickerConfig"
    assert set(cfg) == {"apiVersion", "kind", "plugins", "schedulingProfiles"}
    declared = [p.get("name", p["type"]) for p in cfg["plugins"]]
    assert len(declared) == len(set(declared))
    (profile,) = cfg["schedulingProfiles"]
    refs = {r["pluginRef"]: r.get("weight") for r in profile["plugins"]}
    assert set(refs) == set(declared), (refs, declared)
    assert refs == {"queue-scorer": 2, "kv-cache-utilization-scorer": 1,
                    "prefix-cache-scorer": 3, "max-score-picker": None}
    weights = picker_config(render({**VALUES, "inferenceGateway": {
        **VALUES["inferenceGateway"], "weights": {"queue": 5, "kvCacheUtilization": 0.5,
                                                  "prefixCache": 0}}}))
    assert [r.get("weight") for r in weights["schedulingProfiles"][0]["plugins"]] == \
        [5, 0.5, 0, None]


def test_off_by_default() -> None:
    assert not {"InferencePool", "HTTPRoute"} & {o["kind"] for o in render(
        {"vllm": {"enabled": True}})}


@pytest.mark.parametrize("values,line", [
    ({"inferenceGateway": {"enabled": True}},
     "inferenceGateway.enabled: the InferencePool is the vLLM tenants' pods; set vllm.enabled"),
    ({"vllm": {"enabled": True}, "inferenceGateway": {
        "enabled": True, "endpointPicker": {"failureMode": "Sometimes"}}},
     'inferenceGateway.endpointPicker.failureMode "Sometimes": FailClose or FailOpen'),
    ({"vllm": {"enabled": True}, "inferenceGateway": {"enabled": True, "gateway": {"name": ""}}},
     "inferenceGateway.gateway.name is empty"),
    ({"vllm": {"enabled": True}, "inferenceGateway": {"enabled": True, "path": "v1"}},
     'inferenceGateway.path "v1": a path prefix starting with /'),
    ({"vllm": {"enabled": True}, "inferenceGateway": {"enabled": True,
                                                       "weights": {"queue": "high"}}},
     "inferenceGateway.weights.queue high: a number, 0 or more"),
])
def test_bad_gateway_values_are_one_line(values: dict[str, Any], line: str) -> None:
    from helm_python import HelmError

    with pytest.raises(HelmError) as e:
        render(values)
    assert "\n" not in str(e.value).strip() and line in str(e.value), str(e.value)


@pytest.mark.parametrize("old,new,says", [
    ("app.kubernetes.io/component: vllm\n  targetPorts:", "app.kubernetes.io/component: server"
     "\n  targetPorts:", "the pool selects \\[\\]"),
    ("- number: {{ .Values.vllm.port | int }}", "- number: 8080", "8080"),
    ("          kind: InferencePool\n", "          kind: Service\n", "Service"),
    ("    port:\n      number: {{ $g.endpointPicker.port | int }}",
     "    portNumber: {{ $g.endpointPicker.port | int }}", "portNumber"),
])
def test_each_check_fails_on_a_broken_chart(old: str, new: str, says: str,
                                            tmp_path: Path) -> None:
    objs = render(VALUES, chart=broken_chart(tmp_path, "inference-gateway.yaml", old, new))
    with pytest.raises((AssertionError, KeyError), match=says):
        check_pool_selects_the_servers(objs)
