"""Who may be a tenant on Kubernetes, as the chart ships it (docs/KUBERNETES.md "Identity
on Kubernetes"): the ValidatingAdmissionPolicies and their bindings, and the
NetworkPolicies, rendered offline; the policies' CEL evaluated offline (cel-python) on
the attacks (uid 0, the daemon's uid, no uid, runAsNonRoot false, privilege, a writable
or parent mount, another hostPath in a tenant namespace, a uid outside the namespace's
range) and on the chart's own tenants, which must pass. Schema validity of the new
objects is test_chart_render.py's (every rendered object, two Kubernetes versions)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from .chart import ALL_TENANTS, NAMESPACE, Obj, broken_chart, one, pod_specs, render

IDENTITY, HOST_PATHS = "-tenant-identity", "-tenant-host-paths"
RUN = "/run/kvpool"
DAEMON_UID = 64001


def tenant_pod(**sc: Any) -> Obj:
    """A pod as the chart's examples make them (passes), with pod securityContext ``sc``
    merged in."""
    objs = render({"server": {"enabled": True}})
    spec = copy.deepcopy(one(objs, "Deployment", "-server")["spec"]["template"]["spec"])
    spec["securityContext"].update(sc)
    return {"metadata": {"namespace": "team-a"}, "spec": spec}


def container(pod: Obj) -> Obj:
    return pod["spec"]["containers"][0]


def policy(kind_suffix: str, values: dict[str, Any] | None = None,
           chart: Path | None = None) -> Obj:
    objs = render(values, **({"chart": chart} if chart else {}))
    return one(objs, "ValidatingAdmissionPolicy", kind_suffix)


# ---- as data: the objects and their selectors --------------------------------------------
def test_the_policies_and_bindings_exist_with_their_scope() -> None:
    objs = render()
    for suffix in (IDENTITY, HOST_PATHS):
        p = one(objs, "ValidatingAdmissionPolicy", suffix)
        assert p["spec"]["failurePolicy"] == "Fail"
        (rule,) = p["spec"]["matchConstraints"]["resourceRules"]
        assert rule["apiGroups"] == [""] and set(rule["operations"]) == {"CREATE", "UPDATE"}
        assert set(rule["resources"]) == {"pods", "pods/ephemeralcontainers"}
        b = one(objs, "ValidatingAdmissionPolicyBinding", suffix)
        assert b["spec"]["policyName"] == p["metadata"]["name"]
        assert b["spec"]["validationActions"] == ["Deny"]
    sel = one(objs, "ValidatingAdmissionPolicyBinding", IDENTITY)["spec"]["matchResources"]
    (expr,) = sel["namespaceSelector"]["matchExpressions"]
    assert expr == {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                    "values": [NAMESPACE, "kube-system"]}  # every namespace but these
    sel = one(objs, "ValidatingAdmissionPolicyBinding", HOST_PATHS)["spec"]["matchResources"]
    assert sel["namespaceSelector"]["matchLabels"] == {"kvpool.io/tenant": "true"}
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
            "values": [NAMESPACE]} in sel["namespaceSelector"]["matchExpressions"]
    text = str(one(objs, "ValidatingAdmissionPolicy", IDENTITY)["spec"])
    for piece in ("runAsUser", f"!= {DAEMON_UID}", "runAsNonRoot", "privileged",
                  "allowPrivilegeEscalation", "capabilities.add", "readOnly", "ephemeralContainers",
                  "initContainers", f"'{RUN}'", "'/var/run/kvpool/'", "kvpool.io/uid-min"):
        assert piece in text, piece


def test_values_configure_them_and_turn_them_off() -> None:
    objs = render({"admission": {"validationActions": ["Warn", "Audit"],
                                 "exemptNamespaces": ["kube-system", "monitoring"]},
                   "daemon": {"uid": 5000}, "runDir": "/var/run/kvp"})
    b = one(objs, "ValidatingAdmissionPolicyBinding", IDENTITY)
    assert b["spec"]["validationActions"] == ["Warn", "Audit"]
    assert b["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] \
        == [NAMESPACE, "kube-system", "monitoring"]
    text = str(one(objs, "ValidatingAdmissionPolicy", IDENTITY)["spec"])
    assert "!= 5000" in text and "'/var/run/kvp'" in text and "'/run/kvp/'" in text
    off = render({"admission": {"enabled": False}, "networkPolicy": {"enabled": False}})
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                "NetworkPolicy"} & {o["kind"] for o in off}


def test_a_run_dir_that_would_break_the_cel_is_a_render_error() -> None:
    with pytest.raises(Exception, match="runDir"):
        render({"runDir": "/run/kv'pool"})
    with pytest.raises(Exception, match="allowedCapabilities"):
        render({"admission": {"allowedCapabilities": ["X') || true || ('"]}})


def test_network_policies_fence_the_metrics_and_the_tenants_ports() -> None:
    objs = render(dict(ALL_TENANTS))
    ds = one(objs, "DaemonSet")
    np = one(objs, "NetworkPolicy", "-daemon")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9400}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    # metrics off: the daemon's pods accept nothing over the network
    np = one(render({"metrics": {"enabled": False}}), "NetworkPolicy", "-daemon")
    assert np["spec"]["ingress"] == [] and np["spec"]["policyTypes"] == ["Ingress"]
    tenants = one(objs, "NetworkPolicy", "-tenants")
    (rule,) = tenants["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "http"}]
    exprs = {e["key"]: e["values"] for e in tenants["spec"]["podSelector"]["matchExpressions"]}
    for obj, spec in pod_specs(objs, ("Deployment",)):  # it selects every HTTP tenant
        pod_labels = obj["spec"]["template"]["metadata"]["labels"]
        assert all(pod_labels.get(k) in v for k, v in exprs.items()), obj["metadata"]["name"]
        assert any(p.get("name") == "http" for c in spec["containers"] for p in c["ports"])
    assert "NetworkPolicy" not in {o["kind"] for o in render() if o["metadata"]["name"]
                                   .endswith("-tenants")}


def test_the_bundled_server_gets_its_control_token_from_a_secret() -> None:
    objs = render({"server": {"enabled": True, "controlTokenSecret": {"name": "ctl"}}})
    (ctr,) = one(objs, "Deployment", "-server")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["KVPOOL_CONTROL_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "ctl",
                                                                         "key": "token"}}
    (ctr,) = one(render({"server": {"enabled": True}}), "Deployment",
                 "-server")["spec"]["template"]["spec"]["containers"]
    assert "KVPOOL_CONTROL_TOKEN" not in {e["name"] for e in ctr["env"]}


# ---- the CEL, evaluated --------------------------------------------------------------------
def test_the_charts_own_tenants_pass() -> None:
    from .cel_policy import admit

    objs = render(dict(ALL_TENANTS))
    p = one(objs, "ValidatingAdmissionPolicy", IDENTITY)
    h = one(objs, "ValidatingAdmissionPolicy", HOST_PATHS)
    seen = 0
    for obj, spec in pod_specs(objs, ("Deployment", "Job")):
        pod = {"metadata": {"namespace": "team-a"}, "spec": spec}
        assert admit(p, pod) == [], obj["metadata"]["name"]
        assert admit(h, pod) == [], obj["metadata"]["name"]
        seen += 1
    assert seen == 3
    # the daemon's own pod would be refused: the release namespace is left out for it
    ds = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert admit(p, {"metadata": {}, "spec": ds})


def _attacks() -> list[tuple[str, Obj, str]]:
    """(what, pod, a piece of the refusal's message)."""
    out: list[tuple[str, Obj, str]] = []
    out.append(("root pod", tenant_pod(runAsUser=0), "non-root uid"))
    pod = tenant_pod()
    container(pod)["securityContext"]["runAsUser"] = 0
    out.append(("root container over a non-root pod", pod, "non-root uid"))
    pod = tenant_pod()
    del pod["spec"]["securityContext"]["runAsUser"]
    out.append(("no uid (the image's USER decides)", pod, "non-root uid"))
    out.append(("the daemon's uid", tenant_pod(runAsUser=DAEMON_UID), "the kvpool daemon's"))
    out.append(("runAsNonRoot false", tenant_pod(runAsNonRoot=False), "runAsNonRoot false"))
    for field, value in (("privileged", True), ("allowPrivilegeEscalation", True),
                         ("capabilities", {"add": ["SETUID"]})):
        pod = tenant_pod()
        container(pod)["securityContext"][field] = value
        out.append((f"{field}={value}", pod, "not privileged"))
    pod = tenant_pod()
    del container(pod)["securityContext"]["allowPrivilegeEscalation"]  # default: true
    out.append(("escalation left at its default", pod, "not privileged"))
    pod = tenant_pod()
    for m in container(pod)["volumeMounts"]:
        m["readOnly"] = False
    out.append(("a writable mount", pod, "read-only"))
    for path in ("/", "/run", "/run/", "/run//kvpool", "/run/kvpool/../kvpool",
                 "/var/run/kvpool", "/var/run", "/run/kvpool/control.sock", "run/kvpool"):
        pod = tenant_pod()
        pod["spec"]["volumes"][0]["hostPath"]["path"] = path
        out.append((f"hostPath {path}", pod, "itself, not a parent"))
    pod = tenant_pod()
    pod["spec"]["initContainers"] = [{"name": "i", "image": "x",
                                      "securityContext": {"runAsUser": 0}}]
    out.append(("a root init container", pod, "non-root uid"))
    pod = tenant_pod()
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "x",
                                           "securityContext": {"runAsUser": DAEMON_UID}}]
    out.append(("an ephemeral container as the daemon", pod, "the kvpool daemon's"))
    return out


@pytest.mark.parametrize("what,pod,piece", _attacks(), ids=[a[0] for a in _attacks()])
def test_the_identity_policy_refuses(what: str, pod: Obj, piece: str) -> None:
    from .cel_policy import admit

    refused = admit(policy(IDENTITY), pod)
    assert refused, f"{what}: admitted"
    assert any(piece in m for m in refused), refused


def test_pods_that_do_not_reach_the_run_dir_are_not_its_business() -> None:
    from .cel_policy import admit

    pod = tenant_pod(runAsUser=0)
    pod["spec"]["volumes"] = [{"name": "kvpool-run", "emptyDir": {}}]
    assert admit(policy(IDENTITY), pod) is None
    pod["spec"]["volumes"] = [{"name": "kvpool-run", "hostPath": {"path": "/runx/kvpool"}}]
    assert admit(policy(IDENTITY), pod) is None
    pod = tenant_pod()
    container(pod)["securityContext"]["capabilities"]["add"] = ["NET_BIND_SERVICE"]
    assert admit(policy(IDENTITY), pod) == []


def test_tenant_namespaces_allow_no_other_host_path() -> None:
    from .cel_policy import admit

    pod = tenant_pod()
    pod["spec"]["volumes"].append({"name": "etc", "hostPath": {"path": "/etc"}})
    assert admit(policy(HOST_PATHS), pod) == ["kvpool: in a tenant namespace the only "
                                              "hostPath is /run/kvpool"]
    assert admit(policy(HOST_PATHS), tenant_pod()) == []


def test_a_namespaces_uid_range_binds_its_pods() -> None:
    from .cel_policy import admit

    ns = {"metadata": {"name": "team-a", "annotations": {"kvpool.io/uid-min": "2000",
                                                         "kvpool.io/uid-max": "2999"}}}
    p = policy(IDENTITY)
    assert any("range" in m for m in admit(p, tenant_pod(runAsUser=1000), ns))
    assert any("range" in m for m in admit(p, tenant_pod(runAsUser=3000), ns))
    assert admit(p, tenant_pod(runAsUser=2500, runAsGroup=2500), ns) == []
    assert admit(p, tenant_pod(runAsUser=1000)) == []  # no range, not required
    strict = policy(IDENTITY, {"admission": {"uidRange": {"required": True}}})
    assert any("range" in m for m in admit(strict, tenant_pod(runAsUser=1000)))
    assert admit(strict, tenant_pod(runAsUser=2500), ns) == []
    bad = {"metadata": {"name": "x", "annotations": {"kvpool.io/uid-min": "lots",
                                                     "kvpool.io/uid-max": "9"}}}
    assert admit(p, tenant_pod(runAsUser=5), bad)  # a bad annotation fails closed


@pytest.mark.parametrize("old,new,attack", [
    ('(printf "%s > 0" $uid)', '(printf "%s >= 0" $uid)', "root pod"),
    ("(has(m.readOnly) && m.readOnly)", "true", "a writable mount"),
    ("has(c.securityContext.allowPrivilegeEscalation) && "
     "!c.securityContext.allowPrivilegeEscalation", "true", "escalation left at its default"),
    ("\"p.contains('//')\" ", "", "hostPath /run//kvpool"),
])
def test_a_broken_rule_lets_its_attack_through(tmp_path: Path, old: str, new: str,
                                               attack: str) -> None:
    """Each rule, broken in a copy of the chart, admits its attack: the checks above
    cannot pass with a rule that does nothing."""
    from .cel_policy import admit

    chart = broken_chart(tmp_path, "admission-policy.yaml", old, new)
    (pod,) = [pod for what, pod, _ in _attacks() if what == attack]
    assert not admit(policy(IDENTITY, chart=chart), pod)  # admitted, or not matched
