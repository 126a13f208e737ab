"""``kvpool fleet`` end to end (issue 23, acceptance): a real fleet process that starts its
own daemon (``--with-daemon``) whose budget holds the weights and KV of two of three tiny
models, and real member servers (two eager, one started by its first request).

* every model is served through the one endpoint, with the greedy tokens of the engine
  run alone; the third model's first request makes room by putting an idle one to sleep
  (pressure), and a request for the sleeping one wakes it, served the same;
* ``/v1/models`` and ``kvpool ps`` agree on which are asleep; ``ps`` shows the fleet;
* a client that hangs up mid-stream aborts the upstream request;
* a member killed (SIGKILL) mid-stream: the client gets an SSE error event and the end
  of the stream, the fleet restarts the member (log line, metric), ``kvpool check`` is
  clean, the model serves again;
* SIGTERM stops the fleet, every member (none outlives it) and its daemon.

Outcomes are waited for with generous deadlines, never timed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from kvpool import launch
from kvpool.fleet.member import free_port

from daemon.helpers import PAGE, wait_for

from .prom import metric

REPO = Path(__file__).resolve().parents[2]
BUDGET = 72 * PAGE  # two models' weights (27 pages each) and KV fit; three do not
DEADLINE_S = 180.0
NAMES = ("alpha", "beta", "gamma")
PROMPT = [17, 301, 44, 5, 230, 99, 12, 480, 7, 63, 150, 222, 31, 8, 411, 90]
MAX_TOKENS = 16
FLEET = "tfleet"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvpool.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("fleet-models")
    return {n: make_tiny_model(d / n, layers=2, hidden=128, heads=4, kv_heads=2, vocab=512,
                               seed=i + 1) for i, n in enumerate(NAMES)}


def references(models: dict[str, Path]) -> dict[str, list[int]]:
    """Each model's greedy tokens for PROMPT, from the engine in this process."""
    from kvpool.engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {n: LLM(str(p), num_kv_blocks=16).generate([PROMPT], sp)[0].output_token_ids
            for n, p in models.items()}


@dataclass
class Fleet:
    url: str
    proc: subprocess.Popen
    log: Path
    refs: dict[str, list[int]]
    run_dir: Path = Path()

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def models(self) -> dict[str, dict]:
        r = httpx.get(f"{self.url}/v1/models", timeout=30)
        return {m["id"]: m for m in r.json()["data"]}

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def cli(self, *args: str) -> str:
        out = subprocess.run([*launch.cli_argv(), *args, "--run-dir", str(self.run_dir)],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out
        return out.stdout

    def ps(self) -> dict[str, dict]:
        rows = json.loads(self.cli("ps", "--json"))["tenants"]
        return {t["name"]: t for t in rows if t["group"] == FLEET}

    def check(self) -> list[str]:
        from kvpool.client_lib import Monitor

        with Monitor(self.run_dir) as m:
            return m.check()


def fleet_file(path: Path, models: dict[str, Path], port: int, eager: tuple[str, ...]
               ) -> Path:
    text = (f'[fleet]\nname = "{FLEET}"\nport = {port}\nstart_timeout_s = 150\n'
            f'[daemon]\nbudget = "{BUDGET // 1024}KiB"\npage_size = "{PAGE // 1024}KiB"\n')
    for n, p in models.items():
        text += (f'[[models]]\nname = "{n}"\ncheckpoint = "{p}"\nkv_cache_size = "2MiB"\n'
                 f'max_num_seqs = 8\nargs = ["--max-model-len", "1024"]\n'
                 f'eager = {"true" if n in eager else "false"}\n')
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def fleet(models: dict[str, Path], tmp_path_factory):
    """``kvpool fleet --with-daemon``: alpha and beta eager, gamma on its first request.
    At the end: SIGTERM to the fleet alone; it must stop every member and its daemon."""
    d = tmp_path_factory.mktemp("fleet")
    port = free_port()
    f = fleet_file(d / "fleet.toml", models, port, eager=("alpha", "beta"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    argv = [*launch.cli_argv(), "fleet", str(f), "--with-daemon", "--log-dir", str(d / "logs")]
    proc = launch.spawn_process(argv, d / "fleet.log", cwd=REPO, new_session=True,
                                base_env=env)
    fl = Fleet(f"http://127.0.0.1:{port}", proc, d / "fleet.log", {})
    pids: list[int] = []
    try:
        fl.refs = references(models)  # while the fleet starts
        launch.wait_healthy(proc, fl.url, "kvpool fleet", time.monotonic() + DEADLINE_S,
                            fl.logs)
        found = re.search(r"started a daemon on run dir (\S+)", fl.logs())
        assert found, fl.logs()
        fl.run_dir = Path(found.group(1))
        yield fl
        pids = [t["pid"] for t in fl.ps().values()]
    finally:
        code = launch.stop(proc, 60.0)  # SIGTERM to the fleet alone: it stops the rest
        left = [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        for p in left:
            os.kill(p, signal.SIGKILL)
        launch.stop(proc, 10.0, group=True)
    assert code == 0, fl.logs()
    assert not left, f"members outlived the fleet: {left}"
    assert not fl.run_dir.exists(), "its daemon's run dir is left"  # (removed once stopped)
    assert (d / "logs" / "daemon.log").exists()


def complete(fl: Fleet, model: str, stream: bool = False, max_tokens: int = MAX_TOKENS
             ) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    r = httpx.post(f"{fl.url}/v1/completions", json=body, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["token_ids"]
    assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text
    out: list[int] = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                out += c.get("token_ids") or []
    return out


def agree(fl: Fleet) -> bool:
    """Every member the daemon lists is asleep there iff /v1/models says so."""
    listed, ps = fl.models(), fl.ps()
    return bool(ps) and all((ps[n]["state"] == "asleep") == (listed[n]["state"] == "asleep")
                            for n in ps)



def test_three_models_where_two_fit_all_serve_their_tokens(fleet) -> None:
    refs = fleet.refs
    assert fleet.models()["gamma"]["state"] == "stopped"  # lazy: not asked for yet
    assert "gamma" not in fleet.ps()
    assert complete(fleet, "alpha") == refs["alpha"]
    assert complete(fleet, "beta", stream=True) == refs["beta"]
    # gamma's weights do not fit beside the others: an idle sleepable one is put to sleep
    assert complete(fleet, "gamma") == refs["gamma"]
    asleep = wait_for(lambda: [n for n, t in fleet.ps().items() if t["state"] == "asleep"],
                      DEADLINE_S, 0.2, "a member put to sleep")
    wait_for(lambda: agree(fleet), DEADLINE_S, 0.2, "/v1/models and ps agreeing")
    assert set(fleet.ps()) == set(NAMES)
    out = fleet.cli("ps")
    assert "FLEET" in out and FLEET in out, out
    m = fleet.metrics()
    assert sum(metric(m, "kvpool_fleet_sleeps_total", cause="pressure", model=n)
               for n in NAMES) >= 1, m
    # a request for the sleeping one wakes it, same tokens
    name = asleep[0]
    assert complete(fleet, name, stream=True) == refs[name]
    wait_for(lambda: metric(fleet.metrics(), "kvpool_fleet_wakes_total", model=name) >= 1,
             DEADLINE_S, 0.2, "the wake counted")
    m = fleet.metrics()
    assert metric(m, "kvpool_fleet_requests_total", code="200", model=name, replica="0") >= 2
    wait_for(lambda: agree(fleet), DEADLINE_S, 0.2, "/v1/models and ps agreeing again")


def test_404_is_the_single_servers(fleet) -> None:
    complete(fleet, "alpha")  # (awake)
    member = next(r["url"] for m in fleet.models().values() for r in m["replicas"]
                  if r["state"] == "awake")
    body = {"model": "nope", "prompt": "hi", "max_tokens": 2}
    ours = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)
    single = httpx.post(f"{member}/v1/completions", json=body, timeout=30)
    assert ours.status_code == single.status_code == 404
    a, b = ours.json()["error"], single.json()["error"]
    assert set(a) == set(b) and (a["type"], a["code"]) == (b["type"], b["code"]), (a, b)


def stream_lines(fl: Fleet, model: str, max_tokens: int):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{fl.url}/v1/completions", json=body, timeout=DEADLINE_S)


def test_a_client_that_hangs_up_aborts_the_upstream_request(fleet) -> None:
    url = fleet.models()["alpha"]["replicas"][0]["url"]
    complete(fleet, "alpha")  # awake
    with stream_lines(fleet, "alpha", 900) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # it runs; hang up
    wait_for(lambda: 'finished_reason="abort"' in httpx.get(f"{url}/metrics", timeout=30).text,
             DEADLINE_S, 0.2, "the server aborting the request")
    wait_for(lambda: metric(fleet.metrics(), "kvpool_fleet_requests_total", code="499",
                            model="alpha", replica="0") >= 1, DEADLINE_S, 0.2, "499 counted")
    assert metric(fleet.metrics(), "kvpool_fleet_inflight", model="alpha", replica="0") == 0


def test_a_member_killed_mid_stream_is_an_error_event_and_is_restarted(fleet) -> None:
    refs = fleet.refs
    complete(fleet, "alpha")  # awake
    pid = fleet.ps()["alpha"]["pid"]
    lines: list[str] = []
    with stream_lines(fleet, "alpha", 900) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        lines.append(next(it))
        os.kill(pid, signal.SIGKILL)
        lines += list(it)  # the rest arrives, ending cleanly
    lines = [x for x in lines if x]
    text = "\n".join(lines)
    errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {") and '"error"' in x]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "upstream_error", text
    assert lines[-1] == "data: [DONE]", text
    wait_for(lambda: "alpha killed by SIGKILL; restarting" in fleet.logs(), DEADLINE_S,
             0.2, "the restart's log line")
    assert complete(fleet, "alpha") == refs["alpha"]  # served by the new server
    assert fleet.ps()["alpha"]["pid"] != pid
    m = fleet.metrics()
    assert metric(m, "kvpool_fleet_restarts_total", model="alpha") == 1, m
    assert metric(m, "kvpool_fleet_upstream_errors_total", kind="broken", model="alpha") == 1
    wait_for(lambda: fleet.check() == [], DEADLINE_S, 0.2, "kvpool check clean")
