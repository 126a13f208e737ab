"""What stops a pod from declaring more than it claims, in dra.mode=consumable
(docs/KUBERNETES.md "What stops a pod from lying"): the identity policy's rule that a
pod's KVPOOL_MIN is, in bytes, the memory of the one kvpool claim template it
references, and the claim-templates policy that keeps templates named ``kvpool-*`` to
the ones the chart renders, with their amounts (compared as quantities: the API server
shows 16384Mi as 16Gi). The CEL is evaluated offline (cel_policy), each rule also on a
copy of the chart with it broken."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from .chart import NAMESPACE, Obj, broken_chart, one, pod_specs, render

IDENTITY, TEMPLATES = "-tenant-identity", "-claim-templates"
VALUES: dict[str, Any] = {
    "dra": {"mode": "consumable", "consumable": {"tenants": {
        "llama-70b": {"namespace": "team-a", "min": "16Gi"}}}},
    "vllm": {"enabled": True, "min": "8Gi"},
}
BYTES_70B = str(16 << 30)
TEAM_A = {"metadata": {"name": "team-a"}}


def policy(suffix: str, chart: Path | None = None, values: dict[str, Any] | None = None) -> Obj:
    objs = render(values or VALUES, **({"chart": chart} if chart else {}))
    return one(objs, "ValidatingAdmissionPolicy", suffix)


def team_pod(min_value: str | None = BYTES_70B, template: str = "kvpool-llama-70b") -> Obj:
    """A team-a pod shaped as the chart's vLLM tenant (passes the identity rules), that
    references ``template`` and sets KVPOOL_MIN to ``min_value`` (None: unset)."""
    (_, spec), = pod_specs(render(VALUES), ("Deployment",))
    spec = copy.deepcopy(spec)
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    (ctr,) = spec["containers"]
    ctr["env"] = [e for e in ctr["env"] if e["name"] != "KVPOOL_MIN"]
    if min_value is not None:
        ctr["env"].append({"name": "KVPOOL_MIN", "value": min_value})
    return {"metadata": {"namespace": "team-a"}, "spec": spec}


def template(name: str = "kvpool-llama-70b", memory: str = "16Gi",
             device_class: str = "gpu.nvidia.com") -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": device_class, "allocationMode": "ExactCount", "count": 1,
                "capacity": {"requests": {"memory": memory}}}}]}}}}


# ---- a pod's declared minimum --------------------------------------------------------------
def test_a_pod_declaring_its_claim_is_admitted() -> None:
    from .cel_policy import admit

    p = policy(IDENTITY)
    assert admit(p, team_pod(), TEAM_A) == []
    assert admit(p, team_pod(min_value=None), TEAM_A) == []  # no minimum asked: its loss


def test_the_charts_own_consumable_pods_pass() -> None:
    """The chart's tenants (release namespace, exempt from the binding) would pass the
    rule there too: the vLLM and bundled servers' KVPOOL_MIN, the lease Job's none."""
    from .cel_policy import admit

    values = {**VALUES, "server": {"enabled": True, "min": "1Gi"},
              "training": {"enabled": True, "lease": "2Gi"}}
    objs = render(values)
    p = one(objs, "ValidatingAdmissionPolicy", IDENTITY)
    release = {"metadata": {"name": NAMESPACE}}
    seen = 0
    for obj, spec in pod_specs(objs, ("Deployment", "Job")):
        pod = {"metadata": {"namespace": NAMESPACE}, "spec": spec}
        assert admit(p, pod, release) == [], obj["metadata"]["name"]
        seen += 1
    assert seen == 3


def _lies() -> list[tuple[str, Obj]]:
    out = [("more than it claims", team_pod(str(32 << 30))),
           ("another spelling", team_pod("16GiB")),
           ("a minimum without a kvpool claim", team_pod(template="my-own-template"))]
    pod = team_pod()
    pod["spec"]["resourceClaims"].append({"name": "more", "resourceClaimTemplateName":
                                          "kvpool-llama-70b"})
    out.append(("two kvpool claims", pod))
    pod = team_pod()
    pod["spec"]["containers"][0]["env"][-1] = {"name": "KVPOOL_MIN", "valueFrom": {
        "configMapKeyRef": {"name": "x", "key": "min"}}}
    out.append(("a minimum from a ConfigMap", pod))
    pod = team_pod()
    pod["spec"]["initContainers"] = [{**copy.deepcopy(pod["spec"]["containers"][0]),
                                      "name": "init", "env": [{"name": "KVPOOL_MIN",
                                                               "value": "1"}]}]
    out.append(("an init container's minimum", pod))
    return out


@pytest.mark.parametrize("what,pod", _lies(), ids=[w for w, _ in _lies()])
def test_a_pod_declaring_other_than_its_claim_is_refused(what: str, pod: Obj) -> None:
    from .cel_policy import admit

    refused = admit(policy(IDENTITY), pod, TEAM_A)
    assert refused and all("KVPOOL_MIN is the memory" in m for m in refused), (what, refused)


def test_only_consumable_mode_has_the_rule() -> None:
    from .cel_policy import admit

    plain = policy(IDENTITY, values={"vllm": {"enabled": True}})
    assert "claimedMins" not in str(plain)
    assert admit(plain, team_pod(str(32 << 30)), TEAM_A) == []
    assert not [o for o in render({"vllm": {"enabled": True}})
                if o["metadata"]["name"].endswith(TEMPLATES)]


# ---- the claim templates -------------------------------------------------------------------
def test_the_charts_own_templates_pass() -> None:
    from .cel_policy import admit

    objs = render(VALUES)
    p = one(objs, "ValidatingAdmissionPolicy", TEMPLATES)
    b = one(objs, "ValidatingAdmissionPolicyBinding", TEMPLATES)
    assert b["spec"]["policyName"] == p["metadata"]["name"]
    assert "matchResources" not in b["spec"]  # every namespace
    (rule,) = p["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resources"] == [
        "resourceclaimtemplates"]
    seen = []
    for t in (o for o in objs if o["kind"] == "ResourceClaimTemplate"):
        ns = {"metadata": {"name": t["metadata"]["namespace"]}}
        assert admit(p, t, ns) == [], t["metadata"]["name"]
        seen.append((t["metadata"]["namespace"], t["metadata"]["name"]))
    assert sorted(seen) == [(NAMESPACE, "kvpool-llama-8b"), ("team-a", "kvpool-llama-70b")]
    # the API server shows a quantity canonical: the same amount spelled otherwise passes
    assert admit(p, template(memory="16384Mi"), TEAM_A) == []
    assert admit(p, template(memory=str(16 << 30)), TEAM_A) == []
    assert admit(p, template(name="mine", memory="1Gi"), TEAM_A) is None  # not a kvpool name


@pytest.mark.parametrize("what,obj,ns,piece", [
    ("less than the tenant's minimum", template(memory="1Gi"), TEAM_A, "claims exactly"),
    ("more than the tenant's minimum", template(memory="32Gi"), TEAM_A, "claims exactly"),
    ("a kvpool name in another namespace", template(), {"metadata": {"name": "team-b"}},
     "this one is not"),
    ("a kvpool name the chart never made", template(name="kvpool-other"), TEAM_A,
     "this one is not"),
    ("another DeviceClass", template(device_class="cheap.example.com"), TEAM_A,
     "one request of the DeviceClass gpu.nvidia.com"),
    ("no amount", {**template(), "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}}}, TEAM_A,
     "claims exactly"),
])
def test_a_template_that_is_not_the_charts_is_refused(what: str, obj: Obj, ns: Obj,
                                                      piece: str) -> None:
    from .cel_policy import admit

    refused = admit(policy(TEMPLATES), obj, ns)
    assert refused and any(piece in m for m in refused), (what, refused)


# ---- each rule broken once -------------------------------------------------------------------
def test_a_broken_pod_rule_lets_the_lie_through(tmp_path: Path) -> None:
    from .cel_policy import admit

    chart = broken_chart(tmp_path, "admission-policy.yaml",
                         "e.value == variables.claimedMins[0]", "true")
    assert admit(policy(IDENTITY, chart=chart), team_pod(str(32 << 30)), TEAM_A) == []


def test_a_broken_template_rule_lets_a_small_claim_through(tmp_path: Path) -> None:
    from .cel_policy import admit

    chart = broken_chart(tmp_path, "admission-policy.yaml",
                         "quantity(variables.memory).asInteger() ==",
                         "quantity(variables.memory).asInteger() <=")
    assert admit(policy(TEMPLATES, chart=chart), template(memory="1Gi"), TEAM_A) == []
