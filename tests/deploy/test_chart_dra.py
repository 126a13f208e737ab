"""The chart's DRA modes (docs/KUBERNETES.md "GPU access: device plugin or DRA"), rendered
offline: every object valid for every Kubernetes version from 1.35 (resource.k8s.io/v1
GA) to 1.37 that kubernetes-validate carries; in ``shared`` mode one named ResourceClaim
per node, referenced by that node's daemon and by every tenant pod placed there; in
``consumable`` mode each tenant pod's claim of memory equal to the minimum it declares
(KVPOOL_MIN, the lease); a malformed combination of values is one line from `helm
template`. Each claim property is also checked on a copy of the chart with it broken.
That the daemon then gives each tenant its claim as its min: test_chart_daemon.py; the
admission rules of consumable mode: test_chart_dra_admission.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpool.engine_adapters.env import tenant_fields
from kvpool.sizes import parse_size

from .chart import (ALL_TENANTS, DRA_KUBE_VERSIONS, NAMESPACE, TENANT_KINDS, Obj, arg_after,
                    broken_chart, check_daemon_not_root, check_one_daemon_per_node,
                    check_probes_call_daemon, check_socket_dir, check_socket_group,
                    config_toml, daemon_container, daemonsets, pod_specs, quantity_bytes,
                    render, tomllib)

kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="kubernetes-validate (the `test` extra)")
from helm_python import HelmError  # noqa: E402  (after the skip: the `test` extra)

NODES = ["gpu-node-1", "gpu-node-2"]
SHARED: dict[str, Any] = {
    "dra": {"mode": "shared", "shared": {"nodes": NODES}},
    "vllm": {"enabled": True, "node": "gpu-node-2"},
    "server": {"enabled": True},                      # (the first node)
    "training": {"enabled": True, "node": "gpu-node-2"},
}
EXTERNAL = {"llama-70b": {"namespace": "team-a", "min": "16Gi"},
            "small": {"namespace": "team-b", "min": 268435456}}  # a YAML number of bytes
CONSUMABLE: dict[str, Any] = {
    "dra": {"mode": "consumable", "consumable": {"tenants": EXTERNAL}},
    "vllm": {"enabled": True, "min": "8Gi"},
    "server": {"enabled": True, "min": "1536Mi"},
    "training": {"enabled": True, "lease": "4Gi"},
}
MODES = {"device-plugin": dict(ALL_TENANTS), "shared": SHARED, "consumable": CONSUMABLE,
         "consumable-with-device-class": {**CONSUMABLE, "dra": {
             **CONSUMABLE["dra"], "deviceClass": {"create": True}}}}


def containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(ctr: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in ctr.get("env", []) if "value" in e}


# ---- every object, every DRA version --------------------------------------------------------
def test_the_validator_carries_every_dra_version() -> None:
    """kubernetes-validate has the schemas of 1.35, 1.36 and 1.37, each with the
    resource.k8s.io/v1 kinds and consumable capacity's fields (else the tests below
    would check less than they say)."""
    from kubernetes_validate.utils import all_versions

    assert set(DRA_KUBE_VERSIONS) <= set(all_versions())
    for version in DRA_KUBE_VERSIONS:
        for kind, field in (("ResourceClaimTemplate", None), ("DeviceClass", None),
                            ("ResourceClaim", None)):
            obj = {"apiVersion": "resource.k8s.io/v1", "kind": kind,
                   "metadata": {"name": "x"}, "spec": {"bogus": 1}}
            with pytest.raises(kubernetes_validate.ValidationError, match="bogus"):
                kubernetes_validate.validate(obj, version, strict=True)
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": "x"}, "spec": {"devices": {"requests": [
                     {"name": "gpu", "exactly": {"deviceClassName": "c", "capacity": {
                         "requests": {"memory": "1Gi"}}}}]}}}
        kubernetes_validate.validate(claim, version, strict=True)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_is_valid_for_every_dra_version(mode: str) -> None:
    objs = render(MODES[mode])
    kinds = {o["kind"] for o in objs}
    assert {"DaemonSet", "Deployment", "Job"} <= kinds
    if mode == "shared":
        assert "ResourceClaim" in kinds
    if mode.startswith("consumable"):
        assert "ResourceClaimTemplate" in kinds
    assert ("DeviceClass" in kinds) == mode.endswith("device-class")
    for obj in objs:
        for version in DRA_KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{mode}: {obj['kind']} {obj['metadata']['name']} invalid for "
                            f"Kubernetes {version}: {e.message}")


@pytest.mark.parametrize("mode", ["shared", "consumable"])
def test_the_daemon_properties_hold_in_each_mode(mode: str) -> None:
    """What the chart guarantees of the daemon holds in the DRA modes too (shared: two
    DaemonSets, each pinned to its node)."""
    objs = render(MODES[mode])
    check_socket_dir(objs, "/run/kvpool")
    check_socket_group(objs)
    check_daemon_not_root(objs, root_allowed=False)
    check_one_daemon_per_node(objs)
    check_probes_call_daemon(objs, "/run/kvpool")
    assert len(daemonsets(objs)) == (len(NODES) if mode == "shared" else 1)


# ---- the properties of each mode ------------------------------------------------------------
def check_device_plugin(objs: list[Obj], resource: str = "nvidia.com/gpu") -> None:
    """Device-plugin mode: each tenant container requests the GPU resource, no pod
    references a claim, no DRA object exists."""
    assert not [o for o in objs if o["apiVersion"].startswith("resource.k8s.io/")]
    for obj, spec in pod_specs(objs, (*TENANT_KINDS, "DaemonSet")):
        assert "resourceClaims" not in spec, obj["metadata"]["name"]
        for ctr in spec["containers"]:
            limits = ctr.get("resources", {}).get("limits", {})
            if obj["kind"] in TENANT_KINDS:
                assert limits.get(resource) == 1, f"{ctr['name']}: no {resource}"
            else:
                assert resource not in limits, "the daemon takes a GPU from the tenants"


def check_shared_claims(objs: list[Obj], nodes: list[str]) -> None:
    """One named ResourceClaim per node; that node's DaemonSet (pinned there) references
    it; every tenant pod references the claim of the node it is pinned to, in its own
    namespace, from every container; nothing asks the device plugin for a GPU."""
    claims = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ResourceClaim"}
    assert len(claims) == len(nodes), sorted(claims)
    by_node: dict[str, str] = {}
    for name, claim in claims.items():
        node = claim["metadata"]["labels"]["kvpool.io/node"]
        by_node[node] = name
        assert claim["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        (req,) = claim["spec"]["devices"]["requests"]
        assert req["exactly"]["deviceClassName"]
    assert sorted(by_node) == sorted(nodes)
    users: dict[str, list[str]] = {name: [] for name in claims}
    for obj, spec in pod_specs(objs, (*TENANT_KINDS, "DaemonSet")):
        what = f"{obj['kind']} {obj['metadata']['name']}"
        node = spec.get("nodeSelector", {}).get("kubernetes.io/hostname")
        assert node in by_node, f"{what}: pinned to {node}, not to a node with a claim"
        refs = spec.get("resourceClaims", [])
        assert [r.get("resourceClaimName") for r in refs] == [by_node[node]], \
            f"{what} on {node} references {refs}, not {by_node[node]}"
        assert obj["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        users[by_node[node]].append(obj["kind"])
        for ctr in spec["containers"]:
            res = ctr.get("resources", {})
            assert res.get("claims") == [{"name": refs[0]["name"]}], \
                f"{what}/{ctr['name']} does not use the pod's claim"
            assert "nvidia.com/gpu" not in {**res.get("limits", {}), **res.get("requests", {})}
            if obj["kind"] == "DaemonSet":  # the claim gives the devices, not the runtime
                assert "NVIDIA_VISIBLE_DEVICES" not in env_of(ctr)
    for name, kinds in users.items():
        assert kinds.count("DaemonSet") == 1, f"{name}: used by {kinds}"


def check_consumable_claims(objs: list[Obj]) -> dict[str, int]:
    """Every tenant pod references one ResourceClaimTemplate (in its namespace) claiming
    `memory` of a GPU; the minimum it declares (KVPOOL_MIN; a lease Job's lease) is that
    amount, read as kvpool reads it; no configured [tenants.NAME] min overrides it.
    Returns {tenant: bytes} for the example tenants."""
    templates = {(o["metadata"].get("namespace", NAMESPACE), o["metadata"]["name"]): o
                 for o in objs if o["kind"] == "ResourceClaimTemplate"}
    configured = tomllib.loads(config_toml(objs)).get("tenants", {})
    got: dict[str, int] = {}
    for obj, spec in pod_specs(objs, TENANT_KINDS):
        what = f"{obj['kind']} {obj['metadata']['name']}"
        (ref,) = spec["resourceClaims"]
        key = (obj["metadata"].get("namespace", NAMESPACE), ref["resourceClaimTemplateName"])
        assert key in templates, f"{what}: no template {key}"
        (req,) = templates[key]["spec"]["spec"]["devices"]["requests"]
        assert req["exactly"]["count"] == 1
        claimed = quantity_bytes(req["exactly"]["capacity"]["requests"]["memory"])
        (ctr,) = spec["containers"]
        assert ctr["resources"]["claims"] == [{"name": ref["name"]}], what
        env = env_of(ctr)
        if ctr["command"][:2] == ["kvpool", "lease"]:
            declared, name = parse_size(ctr["command"][2]), arg_after(ctr["command"], "--name")
        else:
            fields = tenant_fields(env, {"name", "min_bytes"})
            declared, name = fields.get("min_bytes", 0), fields["name"]
        assert declared == claimed, f"{what}: declares {declared} bytes, claims {claimed}"
        assert "min" not in configured.get(name, {}), f"config.tenants.{name}.min overrides"
        got[name] = claimed
    return got


def test_the_device_plugin_mode_is_as_before() -> None:
    check_device_plugin(render(MODES["device-plugin"]))
    check_device_plugin(render({**ALL_TENANTS, "devicePlugin": {"resource": "amd.com/gpu"}}),
                        "amd.com/gpu")
    two = render({"vllm": {"enabled": True, "resources": {"limits": {"nvidia.com/gpu": 2}}}})
    (_, spec), = pod_specs(two, TENANT_KINDS)
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 2}


def test_shared_one_claim_per_node_for_its_daemon_and_tenants() -> None:
    objs = render(SHARED)
    check_shared_claims(objs, NODES)
    pinned = {o["metadata"]["name"]: spec["nodeSelector"]["kubernetes.io/hostname"]
              for o, spec in pod_specs(objs, TENANT_KINDS)}
    assert pinned == {"kvpool-vllm": "gpu-node-2", "kvpool-server": "gpu-node-1",
                      "kvpool-training": "gpu-node-2"}
    all_gpus = render({"dra": {"mode": "shared", "shared": {
        "nodes": ["a"], "allocationMode": "All"}}, "vllm": {"enabled": True}})
    (claim,) = [o for o in all_gpus if o["kind"] == "ResourceClaim"]
    assert claim["spec"]["devices"]["requests"][0]["exactly"] == {
        "deviceClassName": "gpu.nvidia.com", "allocationMode": "All"}


def test_consumable_each_claim_is_the_min_its_tenant_declares() -> None:
    objs = render(CONSUMABLE)
    assert check_consumable_claims(objs) == {"llama-8b": 8 << 30, "bundled": 1536 << 20,
                                             "training": 4 << 30}
    # the tenants outside the chart get their templates, in their namespaces
    outside = {(o["metadata"]["namespace"], o["metadata"]["name"]):
               o["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]
               ["memory"] for o in objs if o["kind"] == "ResourceClaimTemplate"
               and o["metadata"]["namespace"] != NAMESPACE}
    assert outside == {("team-a", "kvpool-llama-70b"): "16Gi",
                       ("team-b", "kvpool-small"): "268435456"}
    # the daemon gets no claim: it allocates the tenants' pages (their claims) itself
    (ds,) = daemonsets(objs)
    assert "resourceClaims" not in ds["spec"]["template"]["spec"]
    assert "NVIDIA_VISIBLE_DEVICES" in env_of(daemon_container(objs, ds))


BREAKS = {
    # (template, text, replacement, what the failing check must say)
    "shared-tenant-claim": ("_dra.tpl", '''resourceClaimName: {{ printf "%s-gpu-%s" $full''',
                            '''resourceClaimName: {{ printf "%s-gpu-x%s" $full''',
                            "references .*kvpool-gpu-xgpu-node"),
    "shared-daemon-pin": ("daemonset.yaml", '$_ := set $sel "kubernetes.io/hostname" $node',
                          '$_ := set $sel "kubernetes.io/hostname" "gpu-node-1"', "gpu-node-1"),
    "consumable-min": ("tenant-vllm.yaml",
                       'value: {{ include "kvpool.dra.bytes" $v.min | quote }}',
                       'value: {{ include "kvpool.dra.bytes" "4Gi" | quote }}',
                       "declares 4294967296 bytes, claims 8589934592"),
    "consumable-lease": ("tenant-training.yaml",
                         '- {{ ternary (include "kvpool.dra.bytes" $v.lease)',
                         '- {{ ternary (include "kvpool.dra.bytes" "1Gi")',
                         "declares 1073741824 bytes, claims 4294967296"),
    "consumable-claim": ("dra.yaml", '''memory: {{ $c.quantity | quote }}''', '''memory: "1Gi"''',
                         "claims 1073741824"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_claim_check_fails_on_a_broken_chart(name: str, tmp_path: Path) -> None:
    template, old, new, says = BREAKS[name]
    objs = render(SHARED if name.startswith("shared") else CONSUMABLE,
                  chart=broken_chart(tmp_path, template, old, new))
    with pytest.raises(AssertionError, match=says):
        if name.startswith("shared"):
            check_shared_claims(objs, NODES)
            check_one_daemon_per_node(objs)
        else:
            check_consumable_claims(objs)


# ---- bad input: one line from `helm template` ------------------------------------------------
S = {"mode": "shared", "shared": {"nodes": ["a"]}}
C = {"mode": "consumable"}
V8 = {"enabled": True, "min": "8Gi"}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("unknown mode", {"dra": {"mode": "exclusive"}},
     'dra.mode "exclusive": one of "" (the device plugin), shared, consumable'),
    ("shared with the device plugin's resource",
     {"dra": S, "vllm": {"enabled": True, "resources": {"limits": {"nvidia.com/gpu": 1}}}},
     "vllm.resources.limits.nvidia.com/gpu: dra.mode=shared gives the GPU through a "
     "ResourceClaim; drop the device plugin's resource"),
    ("consumable with the device plugin's resource requested",
     {"dra": C, "server": {"enabled": True, "min": "1Gi",
                           "resources": {"requests": {"nvidia.com/gpu": 1}}}},
     "server.resources.requests.nvidia.com/gpu: dra.mode=consumable gives the GPU"),
    ("a daemon asking the device plugin",
     {"dra": S, "daemon": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
     "daemon.resources.limits.nvidia.com/gpu"),
    ("shared without nodes", {"dra": {"mode": "shared"}}, "dra.shared.nodes is empty"),
    ("shared, a tenant on an unlisted node",
     {"dra": S, "vllm": {"enabled": True, "node": "b"}},
     'vllm.node "b" is not in dra.shared.nodes (a)'),
    ("shared, a node twice", {"dra": {"mode": "shared", "shared": {"nodes": ["a", "a"]}}},
     "dra.shared.nodes names a node twice"),
    ("shared, not a node name", {"dra": {"mode": "shared", "shared": {"nodes": ["GPU_1"]}}},
     'dra.shared.nodes: "GPU_1" is not a node name'),
    ("shared, a bad allocation mode",
     {"dra": {"mode": "shared", "shared": {"nodes": ["a"], "allocationMode": "Some"}}},
     'dra.shared.allocationMode "Some"'),
    ("nodes outside shared mode", {"dra": {"shared": {"nodes": ["a"]}}},
     'dra.shared.nodes is set but dra.mode is ""'),
    ("a tenant's node outside shared mode", {"vllm": {"enabled": True, "node": "a"}},
     'vllm.node is set but dra.mode is ""'),
    ("no DeviceClass", {"dra": {**S, "deviceClassName": ""}}, 'dra.deviceClassName ""'),
    ("consumable without a min", {"dra": C, "vllm": {"enabled": True}},
     "vllm.min is not set: in dra.mode=consumable each tenant pod claims its guaranteed "
     "minimum"),
    ("consumable, a lease that is a share", {"dra": C, "training": {"enabled": True}},
     'training.lease "40%": a positive whole number of bytes or of Ki, Mi, Gi, Ti'),
    ("consumable, a decimal unit", {"dra": C, "vllm": {"enabled": True, "min": "8G"}},
     'vllm.min "8G": a positive whole number'),
    ("consumable, a fraction", {"dra": C, "vllm": {"enabled": True, "min": "1.5Gi"}},
     'vllm.min "1.5Gi": a positive whole number'),
    ("consumable, kvpool's spelling", {"dra": C, "vllm": {"enabled": True, "min": "8GiB"}},
     'vllm.min "8GiB": a positive whole number'),
    ("consumable, zero", {"dra": C, "vllm": {"enabled": True, "min": "0Gi"}},
     'vllm.min "0Gi": a positive whole number'),
    ("consumable and KVPOOL_MIN in env",
     {"dra": C, "vllm": {**V8, "env": {"KVPOOL_MIN": "4GiB"}}},
     "vllm.env.KVPOOL_MIN: in dra.mode=consumable KVPOOL_MIN is vllm.min"),
    ("consumable and a configured min",
     {"dra": C, "vllm": V8, "config": {"tenants": {"llama-8b": {"min": "4GiB"}}}},
     "config.tenants.llama-8b.min: in dra.mode=consumable the tenant's minimum is its claim"),
    ("consumable, a name no template can have",
     {"dra": C, "vllm": {**V8, "servedModelName": "Llama_8B"}},
     'vllm.servedModelName "Llama_8B": in dra.mode=consumable the tenant name names its '
     "ResourceClaimTemplate"),
    ("consumable, an outside tenant without a namespace",
     {"dra": {**C, "consumable": {"tenants": {"x": {"min": "1Gi"}}}}},
     'dra.consumable.tenants.x.namespace ""'),
    ("consumable, an outside tenant without a min",
     {"dra": {**C, "consumable": {"tenants": {"x": {"namespace": "team-a"}}}}},
     "dra.consumable.tenants.x.min is not set"),
    ("consumable, an outside tenant with an unknown key",
     {"dra": {**C, "consumable": {"tenants": {"x": {"namespace": "a", "min": "1Gi",
                                                    "max": "2Gi"}}}}},
     "dra.consumable.tenants.x: unknown keys max (namespace, min)"),
    ("consumable, an outside tenant named as an example one",
     {"dra": {**C, "consumable": {"tenants": {"llama-8b": {"namespace": "a", "min": "1Gi"}}}},
      "vllm": V8},
     "dra.consumable.tenants.llama-8b: vllm.servedModelName names the same tenant"),
    ("outside tenants outside consumable mode",
     {"dra": {"consumable": {"tenants": {"x": {"namespace": "a", "min": "1Gi"}}}}},
     'dra.consumable.tenants is set but dra.mode is ""'),
    ("a min outside consumable mode", {"dra": S, "vllm": V8},
     'vllm.min is set but dra.mode is "shared"'),
]


@pytest.mark.parametrize("what,values,line", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_combination_is_one_line(what: str, values: dict[str, Any],
                                             line: str) -> None:
    with pytest.raises(HelmError) as e:
        render(values)
    message = str(e.value)
    assert "\n" not in message.strip(), message
    assert line in message, message
    assert message.startswith("execution error at (kvpool/templates/"), message


def test_the_good_neighbours_of_the_bad_combinations_render() -> None:
    """The values next to each refusal render (the refusals are not over-broad)."""
    render({"dra": S, "vllm": {"enabled": True, "node": "a"}})
    render({"dra": {"mode": "shared", "shared": {"nodes": ["a"], "allocationMode": "All",
                                                 "count": 0}}})
    render({"dra": C, "vllm": {"enabled": True, "min": 4096}, "training": {"lease": "40%"}})
    render({"dra": C, "vllm": V8, "config": {"tenants": {"llama-8b": {"max": "60%"}}}})
    render({"dra": C, "vllm": {**V8, "env": {"KVPOOL_MAX": "16GiB"}}})
    render({"dra": S, "vllm": {"enabled": True, "resources": {"limits": {"memory": "8Gi"}}}})
    render({"vllm": {"enabled": True, "env": {"KVPOOL_MIN": "4GiB"}}})
