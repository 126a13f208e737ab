"""The kvpool Helm chart as objects: rendered offline (``helm_python``, Helm v4 as a
library), with the property checks the tests apply to every set of values.

Each ``check_*`` takes the rendered objects and raises AssertionError naming what is
wrong; the tests run them on the default values and every example values file, and on
copies of the chart with the property broken (:func:`broken_chart`) to see them fail.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk (the `test` extra)")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kvpool"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "kvpool", "kvpool"
TENANT_KINDS = ("Deployment", "Job")
# every example tenant on at once (the socket-directory property needs them)
ALL_TENANTS = {"vllm": {"enabled": True}, "server": {"enabled": True},
               "training": {"enabled": True}}
# resource.k8s.io/v1 (DRA) is GA from 1.35: objects of the DRA modes, and pods that
# reference claims (PodResourceClaim's fields changed in 1.31), are checked on these
DRA_KUBE_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
# kinds no Kubernetes schema knows (CRDs): checked by what they must select
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "InferencePool", "HTTPRoute"}

Obj = dict[str, Any]


def values_of(path: Path | None) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {} if path else {}


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[Obj]:
    """Every object the chart renders for ``values`` (manifests only, NOTES left out)."""
    out = helm_python.Chart.load(str(chart)).render(values or {}, name=RELEASE,
                                                   namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def one(objs: list[Obj], kind: str, name_suffix: str = "") -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {len(found)}"
    return found[0]


def daemonsets(objs: list[Obj]) -> list[Obj]:
    """The daemon's DaemonSets: one, or one per node in dra.mode=shared."""
    found = [o for o in objs if o["kind"] == "DaemonSet"]
    assert found, "no DaemonSet"
    return found


def daemon_container(objs: list[Obj], ds: Obj | None = None) -> Obj:
    """The daemon container of ``ds`` (default: of the one DaemonSet)."""
    ds = ds or one(objs, "DaemonSet")
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "daemon"]
    return c


def uses_dra(obj: Obj) -> bool:
    """A DRA object, or a workload whose pods reference ResourceClaims."""
    if obj["apiVersion"].startswith("resource.k8s.io/"):
        return True
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return bool(spec.get("resourceClaims"))


_BINARY = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def quantity_bytes(text: str) -> int:
    """A Kubernetes quantity of whole bytes, as the chart writes them (8Gi, 4096)."""
    import re

    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti)?", str(text))
    assert m, f"not a binary quantity: {text!r}"
    return int(m.group(1)) * _BINARY[m.group(2) or ""]


def config_toml(objs: list[Obj]) -> str:
    return str(one(objs, "ConfigMap", "-config")["data"]["kvpool.toml"])


def pod_specs(objs: list[Obj], kinds: tuple[str, ...]) -> Iterator[tuple[Obj, Obj]]:
    for o in objs:
        if o["kind"] in kinds:
            yield o, o["spec"]["template"]["spec"]


def broken_chart(tmp: Path, template: str, old: str, new: str) -> Path:
    """A copy of the chart with ``old`` replaced by ``new`` in ``templates/template``
    (``old`` must occur: a mutation that changes nothing proves nothing)."""
    copy = tmp / "kvpool"
    shutil.copytree(CHART, copy)
    path = copy / "templates" / template
    text = path.read_text()
    assert old in text, f"{old!r} not in {template}"
    path.write_text(text.replace(old, new))
    return copy


def arg_after(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


# ---- the properties ---------------------------------------------------------------------
def check_socket_dir(objs: list[Obj], run_dir: str) -> None:
    """The daemon serves from ``run_dir`` (flag and config), a hostPath of that path mounted
    at that path; every tenant pod mounts the same hostPath at the same path and is told
    it (KVPOOL_RUN_DIR)."""
    import tomllib

    for ds in daemonsets(objs):
        assert arg_after(daemon_container(objs, ds)["command"], "--run-dir") == run_dir
    assert tomllib.loads(config_toml(objs))["run_dir"] == run_dir
    pods = [*pod_specs(objs, ("DaemonSet",)), *pod_specs(objs, TENANT_KINDS)]
    for obj, spec in pods:
        host = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", [])
                if "hostPath" in v}
        assert run_dir in host.values(), f"{obj['kind']} {obj['metadata']['name']}: no " \
                                         f"hostPath {run_dir} ({host})"
        for ctr in spec["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in ctr.get("volumeMounts", [])}
            assert host.get(mounts.get(run_dir, "")) == run_dir, \
                f"{obj['metadata']['name']}/{ctr['name']} does not mount {run_dir} at {run_dir}"
            if obj["kind"] in TENANT_KINDS:
                env = {e["name"]: e.get("value") for e in ctr.get("env", [])}
                assert env.get("KVPOOL_RUN_DIR") == run_dir, f"{ctr['name']}: KVPOOL_RUN_DIR"


def check_socket_group(objs: list[Obj]) -> None:
    """Tenants may open the sockets: the run directory is given to the daemon's uid and
    group, tenant pods carry that group and trust that uid."""
    ids = set()
    for ds in daemonsets(objs):
        ds_spec = ds["spec"]["template"]["spec"]
        sc = ds_spec["securityContext"]
        gid, uid = sc["runAsGroup"], sc["runAsUser"]
        ids.add((gid, uid))
        for init in ds_spec.get("initContainers", []):
            assert f"chown {uid}:{gid} " in " ".join(init["command"]), init["command"]
    assert len(ids) == 1, f"daemons of several identities: {ids}"
    for obj, spec in pod_specs(objs, TENANT_KINDS):
        assert gid in spec["securityContext"].get("supplementalGroups", []), \
            f"{obj['metadata']['name']}: not in the socket group {gid}"
        for ctr in spec["containers"]:
            env = {e["name"]: e.get("value") for e in ctr.get("env", [])}
            assert env.get("KVPOOL_DAEMON_UID") == str(uid), f"{ctr['name']}: KVPOOL_DAEMON_UID"


def check_daemon_not_root(objs: list[Obj], root_allowed: bool) -> None:
    """The daemon container runs as a non-root uid (pod or container securityContext,
    runAsNonRoot set, no privilege escalation, no capabilities) unless ``root_allowed``;
    an init container may be root with CAP_CHOWN alone, and nothing is privileged."""
    for ds in daemonsets(objs):
        ds_spec = ds["spec"]["template"]["spec"]
        c = daemon_container(objs, ds)
        sc = {**ds_spec.get("securityContext", {}), **c.get("securityContext", {})}
        for ctr in [*ds_spec.get("initContainers", []), *ds_spec["containers"]]:
            assert not ctr.get("securityContext", {}).get("privileged"), ctr["name"]
        if root_allowed:
            continue
        assert sc.get("runAsUser", 0) != 0, f"daemon runs as uid {sc.get('runAsUser', 0)}"
        assert sc.get("runAsNonRoot") is True, "daemon: runAsNonRoot not set"
        assert sc.get("allowPrivilegeEscalation") is False, "daemon: privilege escalation"
        assert not sc.get("capabilities", {}).get("add"), "daemon: capabilities added"
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], "daemon: capabilities kept"
        for init in ds_spec.get("initContainers", []):
            isc = init.get("securityContext", {})
            assert isc.get("allowPrivilegeEscalation") is False, init["name"]
            assert isc.get("capabilities", {}).get("drop") == ["ALL"], init["name"]
            assert set(isc.get("capabilities", {}).get("add", [])) <= {"CHOWN"}, init["name"]


def check_one_daemon_per_node(objs: list[Obj]) -> None:
    """The daemon is a DaemonSet (one pod per node) whose updates never overlap two pods
    on a node (maxSurge 0, or OnDelete); several DaemonSets (dra.mode=shared) are each
    pinned to their own node (kubernetes.io/hostname) with selectors that do not overlap;
    no other object runs ``kvpool daemon``."""
    sets = daemonsets(objs)
    for ds in sets:
        strategy = ds["spec"].get("updateStrategy", {"type": "RollingUpdate"})
        if strategy["type"] != "OnDelete":
            assert strategy["type"] == "RollingUpdate"
            surge = strategy.get("rollingUpdate", {}).get("maxSurge", 0)
            assert surge in (0, "0", "0%"), f"maxSurge {surge}: two daemons on a node"
    if len(sets) > 1:
        nodes = [ds["spec"]["template"]["spec"].get("nodeSelector", {})
                 .get("kubernetes.io/hostname") for ds in sets]
        assert None not in nodes and len(set(nodes)) == len(nodes), \
            f"two daemons on a node: DaemonSets pinned to {nodes}"
        selectors = [ds["spec"]["selector"]["matchLabels"] for ds in sets]
        for i, a in enumerate(selectors):
            for b in selectors[i + 1:]:
                assert any(k in b and b[k] != v for k, v in a.items()), \
                    f"DaemonSet selectors overlap: {a} {b}"
    runners = [o["metadata"]["name"] for o, spec in pod_specs(objs, (*TENANT_KINDS, "DaemonSet",
                                                                    "StatefulSet"))
               for c in spec["containers"] if c.get("command", [])[:2] == ["kvpool", "daemon"]]
    assert runners == [ds["metadata"]["name"] for ds in sets], runners


def check_probes_call_daemon(objs: list[Obj], run_dir: str) -> None:
    """Startup, liveness and readiness probes run ``kvpool ps|check`` on the run directory."""
    for ds in daemonsets(objs):
        c = daemon_container(objs, ds)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in c, f"no {probe}"
            argv = c[probe].get("exec", {}).get("command")
            assert argv, f"{probe} does not run a command"
            assert argv[0] == "kvpool" and argv[1] in ("ps", "check"), f"{probe}: {argv}"
            assert arg_after(argv, "--run-dir") == run_dir, f"{probe}: {argv}"
