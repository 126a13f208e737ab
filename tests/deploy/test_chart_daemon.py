"""The daemon as the chart starts it: the rendered DaemonSet container's command line
and the rendered ConfigMap's kvpool.toml (examples/host-backend.yaml: the host backend),
run here. Adapted, and only these: ``kvpool`` becomes this interpreter's ``python -m
kvpool.cli.main``; ``--config`` points at a temporary copy of the ConfigMap's file;
``--run-dir`` (the hostPath) becomes a temporary directory; the metrics port in
kvpool.toml becomes a free loopback port (0.0.0.0:9400 could be taken on this machine).
The probes' rendered commands are run with the same adaptations."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from kvpool import launch

from .chart import (CHART, Obj, arg_after, config_toml, daemon_container, one, render,
                    values_of)

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
    objs = render(values_of(VALUES))
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
