"""A fleet as a cluster router sees it (issue 38 items 1 and 3): its own ``/metrics`` in the
router's model-server protocol (its queue, its replicas' KV, asleep), and the
``--endpoints-file`` it keeps current (one entry per model with its state; failed, asleep
and awake shown; emptied when the fleet stops; every write atomic). One real fleet with
its own daemon: ``m`` eager, ``solo`` lazy, ``broken`` whose server cannot start."""

from __future__ import annotations

import math
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from daemon.helpers import wait_for
from kvpool import launch
from kvpool.fleet.member import free_port

from .prom import of_model, samples
from .test_fleet_life import DEADLINE_S, PROMPT, REPO, TOP, Fleet, entry, fleet_file

#: the fleet endpoint's protocol names: name -> (type, meaning), one series per model
PROTOCOL = {
    "vllm:num_requests_waiting": ("gauge", "requests in the fleet's queue for the model"),
    "vllm:num_requests_running": ("gauge", "requests its replicas serve for the fleet"),
    "vllm:kv_cache_usage_perc": ("gauge", "the least KV use among awake replicas, 0..1"),
    "vllm:cache_config_info": ("gauge", "1; block_size, num_gpu_blocks"),
    "kvpool:asleep": ("gauge", "1 when no replica is awake and one is asleep"),
    "kvpool:pool_free_bytes": ("gauge", "the pool's free bytes"),
    "kvpool:granted_bytes": ("gauge", "the replicas' grants together"),
}
MODELS = ("m", "solo", "broken")


def read(fl: Fleet) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    return samples(httpx.get(f"{fl.url}/metrics", timeout=30).text)


def blocks(m: dict, model: str) -> int:
    (labels,) = [dict(ls) for (n, ls) in m if n == "vllm:cache_config_info"
                 and dict(ls)["model_name"] == model]
    return int(labels["num_gpu_blocks"])


def check_protocol(types: dict, m: dict) -> None:
    for name, (kind, meaning) in PROTOCOL.items():
        assert types.get(name) == kind, (name, meaning)
        for model in MODELS:
            of_model(m, name, model)
    for key, v in m.items():
        assert math.isfinite(v) and v >= 0, (key, v)
    for model in MODELS:
        assert 0 <= of_model(m, "vllm:kv_cache_usage_perc", model) <= 1


def endpoints(path) -> dict[str, dict]:
    doc = yaml.safe_load(path.read_text())
    return {e["labels"]["model"]: e for e in doc["endpoints"] or []}


def states(path) -> dict[str, str]:
    return {k: e["labels"]["kvpool.io/state"] for k, e in endpoints(path).items()}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kvpool.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("fleet-endpoints")
    model = make_tiny_model(d / "tiny", layers=2, hidden=128, heads=4, kv_heads=2, vocab=512,
                            seed=1)
    port = free_port()
    broken = entry("broken", model, True).replace('args = ["--max-model-len", "256"]',
                                                  'args = ["--no-such-flag"]')
    toml = fleet_file(d / "ep.toml", port, [entry("m", model, True),
                                            entry("solo", model, False), broken])
    out = d / "endpoints" / "endpoints.yaml"
    out.parent.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    argv = [*TOP, "fleet", str(toml), "--with-daemon", "--log-dir", str(d / "logs"),
            "--endpoints-file", str(out), "--endpoints-address", "10.1.2.3",
            "--endpoints-namespace", "ns1"]
    proc = launch.spawn_process(argv, d / "fleet.log", cwd=REPO, new_session=True,
                                base_env=env)
    fl = Fleet(proc, f"http://127.0.0.1:{port}", d / "fleet.log")
    try:
        fl.wait_healthy()
        yield fl, out, port
    finally:
        fl.stop()


def test_the_endpoints_file_lists_each_model_with_its_state(fleet) -> None:
    fl, path, port = fleet
    wait_for(lambda: states(path) == {"m": "awake", "solo": "stopped", "broken": "failed"},
             DEADLINE_S, 0.1, f"m awake, solo stopped, broken failed: {path.read_text()}")
    e = endpoints(path)
    assert e["m"]["name"] == "life-m" and e["m"]["namespace"] == "ns1"
    assert (e["m"]["address"], e["m"]["port"]) == ("10.1.2.3", port)
    assert e["m"]["labels"]["llm-d.ai/engine-type"] == "kvpool"
    assert e["m"]["labels"]["kvpool.io/fleet"] == "life"
    assert sorted(p.name for p in path.parent.iterdir()) == ["endpoints.yaml"]  # no tmp left
    assert fl.complete("solo").status_code == 200  # started by its first request
    wait_for(lambda: states(path)["solo"] == "awake", DEADLINE_S, 0.1, "solo awake")


def test_the_fleet_speaks_the_routers_protocol_for_its_own_queue(fleet) -> None:
    fl, path, _ = fleet
    wait_for(lambda: states(path)["m"] == "awake", DEADLINE_S, 0.1, "m awake")
    types, idle = wait_for(lambda: (lambda t, m: (t, m) if blocks(m, "m") > 0 else None)(
        *read(fl)), DEADLINE_S, 0.1, "m's KV figures read by the watch")
    check_protocol(types, idle)
    assert of_model(idle, "vllm:num_requests_running", "m") == 0
    assert of_model(idle, "vllm:num_requests_waiting", "m") == 0
    assert of_model(idle, "kvpool:asleep", "m") == 0
    assert of_model(idle, "kvpool:pool_free_bytes", "m") > 0
    assert of_model(idle, "kvpool:granted_bytes", "m") > 0
    assert blocks(idle, "broken") == 0 and of_model(idle, "vllm:kv_cache_usage_perc", "broken") == 0

    # m's engine is stopped (SIGSTOP) so the request stays in flight however fast the tiny
    # model is (a stream's first line can arrive after the request ended: the CI run that
    # read "running 0" here); the gauges are read while it is
    pid = fl.ps()["m"]["pid"]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(httpx.post, f"{fl.url}/v1/completions", json=body,
                            timeout=DEADLINE_S)
            types, busy = wait_for(lambda: (lambda t, m: (t, m) if of_model(
                m, "vllm:num_requests_running", "m") == 1 else None)(*read(fl)),
                DEADLINE_S, 0.1, "m's request in the fleet's gauges")
            check_protocol(types, busy)
            os.kill(pid, signal.SIGCONT)
            assert fut.result().status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)

    run_dir = fl.run_dir()
    out = subprocess.run([*TOP, "sleep", "m", "--run-dir", str(run_dir)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out
    wait_for(lambda: states(path)["m"] == "asleep", DEADLINE_S, 0.1, "m asleep in the file")
    types, asleep = wait_for(lambda: (lambda t, m: (t, m) if of_model(m, "kvpool:asleep", "m") == 1
                                      else None)(*read(fl)), DEADLINE_S, 0.1, "m asleep")
    check_protocol(types, asleep)
    assert of_model(asleep, "vllm:kv_cache_usage_perc", "m") == 0
    assert fl.complete("m").status_code == 200  # woken by a request
    wait_for(lambda: states(path)["m"] == "awake", DEADLINE_S, 0.1, "m awake again")


def test_a_stopped_fleet_leaves_no_endpoint(fleet) -> None:
    fl, path, _ = fleet
    assert fl.stop() == 0
    assert yaml.safe_load(path.read_text())["endpoints"] == []


def test_an_endpoints_file_it_cannot_write_is_one_line_before_anything_starts(tmp_path) -> None:
    from kvpool.engine.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", layers=2, hidden=128, heads=4, kv_heads=2,
                            vocab=512, seed=1)
    toml = fleet_file(tmp_path / "ep.toml", free_port(), [entry("m", model, True)])
    target = tmp_path / "no-such-folder" / "endpoints.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    out = subprocess.run([*TOP, "fleet", str(toml), "--with-daemon", "--log-dir",
                          str(tmp_path / "logs"), "--endpoints-file", str(target)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write the endpoints file" in lines[0], out.stderr
    assert "Traceback" not in out.stderr  # (and no "started a daemon" line before it)


def test_a_killed_fleets_file_is_known_dead_and_the_next_start_rewrites_it(tmp_path) -> None:
    """Issue 38: a fleet killed with SIGKILL cannot empty its file. Its first line names
    the writer (pid with its start time, boot id): a reader on the host sees a dead
    writer's entries; the next fleet on the path rewrites the file at once."""
    from kvpool.discovery import writer_of
    from kvpool.engine.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", layers=2, hidden=128, heads=4, kv_heads=2,
                            vocab=512, seed=1)
    out = tmp_path / "endpoints.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}

    def start(tag: str) -> Fleet:
        port = free_port()
        toml = fleet_file(tmp_path / f"{tag}.toml", port, [entry("lazy", model, False)])
        argv = [*TOP, "fleet", str(toml), "--with-daemon", "--log-dir",
                str(tmp_path / f"logs-{tag}"), "--endpoints-file", str(out)]
        proc = launch.spawn_process(argv, tmp_path / f"{tag}.log", cwd=REPO,
                                    new_session=True, base_env=env)
        fl = Fleet(proc, f"http://127.0.0.1:{port}", tmp_path / f"{tag}.log")
        fl.wait_healthy()
        return fl

    first = start("first")
    try:
        wait_for(lambda: out.exists() and states(out) == {"lazy": "stopped"}, DEADLINE_S, 0.1,
                 "the first fleet's entry")
        w = writer_of(out.read_text())
        assert w is not None and w.pid == first.proc.pid and w.alive() is True
        os.killpg(first.proc.pid, signal.SIGKILL)  # the fleet and its daemon
        first.proc.wait(30)
        assert states(out) == {"lazy": "stopped"}  # its last entries stay...
        assert writer_of(out.read_text()).alive() is False  # ...known to be a dead writer's
    finally:
        first.stop()
    second = start("second")
    try:
        w = writer_of(out.read_text())  # written before the fleet served
        assert w is not None and w.pid == second.proc.pid and w.alive() is True
        assert states(out) == {"lazy": "stopped"}
    finally:
        assert second.stop() == 0
    assert yaml.safe_load(out.read_text())["endpoints"] == []
