"""The daemon as the chart starts it: the rendered DaemonSet container's command line
and the rendered ConfigMap's kvpool.toml (examples/host-backend.yaml: the host backend),
run here; in dra.mode=consumable, with the tenants registering as their rendered pods
would (KVPOOL_TENANT, KVPOOL_MIN; the training Job's `kvpool lease` command line), each
gets its claim's memory as its minimum. Adapted, and only these: ``kvpool`` becomes this
interpreter's ``python -m kvpool.cli.main``; ``--config`` points at a temporary copy of
the ConfigMap's file; ``--run-dir`` (the hostPath) becomes a temporary directory; the
metrics port in kvpool.toml becomes a free loopback port (0.0.0.0:9400 could be taken on
this machine).
The probes' rendered commands are run with the same adaptations."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from kvpool import launch
from kvpool.client_lib import Monitor, connect
from kvpool.engine_adapters.env import tenant_fields

from .chart import (CHART, TENANT_KINDS, Obj, arg_after, config_toml, daemon_container, one,
                    pod_specs, quantity_bytes, render, values_of)

VALUES = CHART / "examples" / "host-backend.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_path(objs: list[Obj]) -> str:
    """Where the daemon container sees kvpool.toml: the ConfigMap volume's mount path."""
    spec = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    (vol,) = [v["name"] for v in spec["volumes"] if "configMap" in v]
    (mount,) = [m["mountPath"] for m in daemon_container(objs)["volumeMounts"]
                if m["name"] == vol]
    return f"{mount}/kvpool.toml"


def local_argv(argv: list[str], replace: dict[str, str]) -> list[str]:
    assert argv[0] == "kvpool", argv
    return [*launch.cli_argv(), *(replace.get(a, a) for a in argv[1:])]


@pytest.fixture
def rendered(tmp_path: Path):
    """(objs, argv adapted, run_dir, metrics port); the run dir removed afterwards."""
    yield from prepared(render(values_of(VALUES)), tmp_path)


def prepared(objs: list[Obj], tmp_path: Path):
    """The rendered daemon's command adapted to run here (see the module)."""
    c = daemon_container(objs)
    assert arg_after(c["command"], "--config") == config_path(objs)
    run_dir = Path(tempfile.mkdtemp(prefix="kvp-helm-", dir="/tmp"))
    port = free_port()
    text = config_toml(objs)
    assert 'metrics_address = "0.0.0.0:9400"' in text
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text(text.replace("0.0.0.0:9400", f"127.0.0.1:{port}"))
    replace = {config_path(objs): str(cfg), arg_after(c["command"], "--run-dir"): str(run_dir)}
    yield objs, replace, local_argv(c["command"], replace), run_dir, port
    shutil.rmtree(run_dir, ignore_errors=True)


def test_rendered_daemon_serves_ps_probes_and_metrics(rendered, tmp_path: Path) -> None:
    objs, replace, argv, run_dir, port = rendered
    log = tmp_path / "daemon.log"
    d = launch.spawn(argv, run_dir, log, cwd=str(Path(__file__).resolve().parents[2]))
    try:
        d.wait_serving(30)
        c = daemon_container(objs)
        outputs = {}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            argv_p = local_argv(c[probe]["exec"]["command"], replace)
            if tuple(argv_p) not in outputs:  # (startup and liveness: the same command)
                out = subprocess.run(argv_p, capture_output=True, text=True,
                                     timeout=c[probe]["timeoutSeconds"] + 20)
                assert out.returncode == 0, (probe, out.stderr)
                outputs[tuple(argv_p)] = out.stdout
        ps = [json.loads(o) for a, o in outputs.items() if "ps" in a]
        assert ps, "no probe runs kvpool ps"  # `kvpool ps` answers
        assert ps[0]["tenants"] == [] and ps[0]["pool"]["backend"] == "host"
        assert ps[0]["pool"]["budget"] == 2 << 30 and ps[0]["pool"]["page_size"] == 2 << 20
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        exported = set()
        for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text.decode(), re.M):
            exported |= {name, f"{name}_total"} if kind == "counter" else {name}
        rules = render({**values_of(VALUES), "metrics": {"prometheusRule": {"enabled": True}}})
        for rule in one(rules, "PrometheusRule")["spec"]["groups"][0]["rules"]:
            for name in re.findall(r"\bkvpool_[a-z_]+", rule["expr"]):
                assert name in exported, f"{rule['alert']}: {name} is not exported"
    finally:
        # as the kubelet stops it: SIGTERM, the daemon's clean stop, within the grace period
        grace = one(objs, "DaemonSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        d.popen.send_signal(signal.SIGTERM)
        try:
            rc = d.popen.wait(grace)
        except subprocess.TimeoutExpired:
            rc = launch.stop(d.popen, 0)
    assert rc == 0, log.read_text()


def test_rendered_daemon_refuses_an_unknown_key(rendered, tmp_path: Path) -> None:
    objs, replace, argv, run_dir, port = rendered
    bad = render({**values_of(VALUES), "config": {**values_of(VALUES)["config"],
                                                  "bogus_knob": 1}})
    cfg = Path(replace[config_path(objs)])
    cfg.write_text(config_toml(bad))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "Error: configuration: unknown configuration keys: bogus_knob"


def test_consumable_tenants_get_their_claims_as_their_minimum(tmp_path: Path) -> None:
    """dra.mode=consumable: the daemon the chart starts, and the tenants as their rendered
    pods join it (the vLLM and bundled servers' KVPOOL_TENANT and KVPOOL_MIN, read as
    every engine adapter reads them; the training Job's `kvpool lease` command line, its
    command one that writes down the lease it was given, KVPOOL_LEASE_BYTES, and waits):
    `kvpool ps` shows each one's minimum (the lease's lease) equal to the memory its
    ResourceClaimTemplate claims."""
    given = tmp_path / "lease-bytes"
    values = {**values_of(VALUES), "dra": {"mode": "consumable"},
              "vllm": {"enabled": True, "min": "512Mi"},
              "server": {"enabled": True, "min": "256Mi"},
              "training": {"enabled": True, "lease": "128Mi", "command": [
                  "sh", "-c", f'echo "$KVPOOL_LEASE_BYTES" > {given}.tmp && '
                              f'mv {given}.tmp {given} && exec sleep 60']}}
    objs = render(values)
    claims = {o["metadata"]["name"]: quantity_bytes(o["spec"]["spec"]["devices"]["requests"][0]
                                                    ["exactly"]["capacity"]["requests"]["memory"])
              for o in objs if o["kind"] == "ResourceClaimTemplate"}
    gen = prepared(objs, tmp_path)
    _, replace, argv, run_dir, _ = next(gen)
    log = tmp_path / "daemon.log"
    d = launch.spawn(argv, run_dir, log, cwd=str(Path(__file__).resolve().parents[2]))
    tenants, lease = [], None
    try:
        d.wait_serving(30)
        want: dict[str, int] = {}
        for obj, spec in pod_specs(objs, TENANT_KINDS):
            (ctr,) = spec["containers"]
            claimed = claims[spec["resourceClaims"][0]["resourceClaimTemplateName"]]
            env = {e["name"]: e["value"] for e in ctr["env"] if "value" in e}
            if ctr["command"][:2] == ["kvpool", "lease"]:
                lease = subprocess.Popen(local_argv(ctr["command"], replace),
                                         env={**env, "KVPOOL_RUN_DIR": str(run_dir),
                                              "PATH": "/usr/bin:/bin"})
                want[arg_after(ctr["command"], "--name")] = claimed
                continue
            s = tenant_fields(env, {"name", "min_bytes"})
            tenants.append(connect(s["name"], run_dir=run_dir, min=s["min_bytes"]))
            want[s["name"]] = claimed
        assert set(want) == {"llama-8b", "bundled", "training"}
        for _ in range(600):  # the lease's command runs once the lease is held
            if given.exists():
                break
            assert lease is not None and lease.poll() is None, log.read_text()
            time.sleep(0.05)
        assert int(given.read_text()) == want["training"]
        with Monitor(run_dir) as m:
            shown = {t.name: max(t.min, t.lease) for t in m.ps().tenants}
        assert shown == want, (shown, want)
    finally:
        for tenant in tenants:
            tenant.close()
        if lease is not None:
            lease.kill()
            lease.wait(30)
        rc = launch.stop(d.popen, 30)
        next(gen, None)
    assert rc == 0, log.read_text()
