"""vLLM members for real (issue 36 item 1): one mixed fleet (a bundled member and a vLLM
member of the tiny Llama, vLLM's CPU build) shared by the module, started once.

* the vLLM member serves the greedy tokens of a lone vLLM server; ``/v1/models`` agrees
  with ``kvpool ps``; the fleet said in one line what a vLLM member cannot do;
* each sleep is counted under its cause (``operator``: ``kvpool sleep``; ``pressure``: a
  tenant that needs the memory; ``idle``: ``sleep_after``), and after each the router's
  ``POST /wake_up`` is the wake (the member logs the wake as ``http``, not as its
  request's; ``kvpool_fleet_wake_seconds`` counts it);
* a wake that cannot get its memory is a 503 of one line before the request is sent;
* a SIGKILLed vLLM member mid-stream is restarted (the reason: the signal), nothing
  leaked (``kvpool check`` clean), the same tokens after;
* the member's log holds none of the fleet's twice-a-second looks.

vLLM server starts cost tens of seconds on a small machine: one fleet for the module,
the tests in order. Outcomes are waited for with generous deadlines, never timed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from daemon.helpers import wait_for  # noqa: E402

from .prom import metric  # noqa: E402
from .test_fleet_life import REPO, TOP, Fleet, start  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
DEADLINE_S = 400.0
SLEEP_AFTER_S = 20  # vl's idle sleep: long enough for a test's steps between requests
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512", "--dtype", "float32"]
PROMPT = "Question 3: what is the weather like in the town by the river? Answer:"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.engine.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vm-model") / "tiny", layers=2,
                           hidden=128, heads=4, kv_heads=2, vocab=512, seed=0)


@pytest.fixture(scope="module")
def lone_tokens(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """The greedy tokens of vLLM alone (no kvpool), its server stopped after."""
    from adapters.vllm_procs import VllmServers  # (its args are VLLM_ARGS and more)

    s = VllmServers(tiny, tmp_path_factory.mktemp("vm-lone"))
    try:
        srv = s.start("vl", None)
        s.wait_healthy()
        return tokens(srv.base)
    finally:
        s.close()


def tokens(base: str) -> list[int]:
    r = httpx.post(f"{base}/v1/completions", timeout=DEADLINE_S, json={
        "model": "vl", "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def fleet(tiny: Path, lone_tokens: list[int], tmp_path_factory: pytest.TempPathFactory):
    from kvpool.fleet.member import free_port

    d = tmp_path_factory.mktemp("vm-fleet")
    port = free_port()
    args = ", ".join(f'"{a}"' for a in VLLM_ARGS)
    toml = d / "vm.toml"
    toml.write_text(
        f'[fleet]\nname = "vm"\nport = {port}\nstart_timeout_s = {DEADLINE_S:g}\n'
        f'hung_after_s = 300\nhung_restart_s = 600\n'
        f'[daemon]\nbudget = "8MiB"\npage_size = "64KiB"\n'
        f'[[models]]\nname = "bun"\ncheckpoint = "{tiny}"\neager = true\n'
        f'sleepable = false\nkv_cache_size = "2MiB"\nmax_num_seqs = 4\n'
        f'args = ["--max-model-len", "256"]\n'
        f'[[models]]\nname = "vl"\nengine = "vllm"\ncheckpoint = "{tiny}"\neager = true\n'
        f'sleep_after = {SLEEP_AFTER_S}\nmax_num_seqs = 8\nargs = [{args}]\n')
    env_before = dict(os.environ)
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        f = start(toml, port, d / "logs")
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    try:
        f.wait_healthy()
        wait_for(lambda: {m["id"]: m["state"] for m in models(f)} ==
                 {"bun": "awake", "vl": "awake"}, DEADLINE_S, 0.5, "both members up")
        yield f
    finally:
        f.stop()


def models(f: Fleet) -> list[dict]:
    return list(httpx.get(f"{f.url}/v1/models", timeout=30).json()["data"])


def member_log(f: Fleet) -> str:
    return (f.log.parent / "logs" / "vl.log").read_text(errors="replace")


def cli(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TOP, *args, "--run-dir", str(f.run_dir())], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def sleeps(f: Fleet, cause: str) -> float:
    text = httpx.get(f"{f.url}/metrics", timeout=30).text
    return metric(text, "kvpool_fleet_sleeps_total", model="vl", cause=cause)


def router_wakes(f: Fleet) -> float:
    text = httpx.get(f"{f.url}/metrics", timeout=30).text
    return metric(text, "kvpool_fleet_wake_seconds_count", model="vl")


def vl_state(f: Fleet) -> str:
    return next(m["state"] for m in models(f) if m["id"] == "vl")


def woken_by_the_router(f: Fleet, lone: list[int]) -> None:
    """A request to the asleep vl: the router's wake wakes it (logged ``http`` by the
    member, counted by the router), then the request gets the lone server's tokens."""
    http_wakes = member_log(f).count("kvpool: awake (http)")
    before = router_wakes(f)
    assert tokens(f.url) == lone
    assert router_wakes(f) == before + 1
    assert member_log(f).count("kvpool: awake (http)") == http_wakes + 1, member_log(f)[-3000:]


def test_serves_the_lone_servers_tokens_and_ps_agrees(fleet: Fleet, lone_tokens) -> None:
    assert tokens(fleet.url) == lone_tokens
    r = httpx.post(f"{fleet.url}/v1/completions", timeout=DEADLINE_S, json={
        "model": "bun", "prompt": [17, 301, 44, 5], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    ps = fleet.ps()
    assert {m["id"] for m in models(fleet)} == set(ps) == {"bun", "vl"}
    assert {t["group"] for t in ps.values()} == {"vm"}
    said = [x for x in fleet.logs().splitlines() if "runs on vLLM" in x]
    assert said == ["fleet: vl runs on vLLM: its weights stay in its own memory, not in the "
                    "pool (a sleep frees its KV cache alone, and no other member shares "
                    "them)"], fleet.logs()


def test_an_operator_sleep_is_counted_as_such_and_the_routers_wake_wakes(
        fleet: Fleet, lone_tokens) -> None:
    tokens(fleet.url)  # a full idle period ahead of the operator's sleep
    assert cli(fleet, "sleep", "vl").returncode == 0
    wait_for(lambda: vl_state(fleet) == "asleep", DEADLINE_S, 0.2, "vl asleep")
    wait_for(lambda: sleeps(fleet, "operator") == 1, DEADLINE_S, 0.2, "counted")
    assert sleeps(fleet, "pressure") == sleeps(fleet, "idle") == 0
    woken_by_the_router(fleet, lone_tokens)


def test_a_pressure_sleep_is_counted_as_such_and_a_wake_without_memory_is_503(
        fleet: Fleet, lone_tokens) -> None:
    from kvpool.client_lib import connect
    from kvpool.client_lib.errors import KvpoolError

    tokens(fleet.url)
    hog = connect(name="hog", run_dir=fleet.run_dir())
    try:
        group = hog.region_group(1, 8 << 20)
        held = 0
        for unit in range((8 << 20) // hog.page_size):
            try:  # everything it can get: vl (idle, sleepable) is put to sleep for it
                group.grant([unit])
            except KvpoolError:
                break
            held += 1
        assert held > 0
        wait_for(lambda: sleeps(fleet, "pressure") == 1, DEADLINE_S, 0.2, "pressure")
        assert sleeps(fleet, "operator") == 1 and sleeps(fleet, "idle") == 0
        wait_for(lambda: vl_state(fleet) == "asleep", DEADLINE_S, 0.2, "vl asleep")
        requests = member_log(fleet).count("POST /v1/completions")
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=DEADLINE_S, json={
            "model": "vl", "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "\n" not in message and "cannot wake" in message, message
        assert member_log(fleet).count("POST /v1/completions") == requests  # never sent
    finally:
        hog.close()
    woken_by_the_router(fleet, lone_tokens)


def test_an_idle_sleep_is_counted_as_such(fleet: Fleet, lone_tokens) -> None:
    wait_for(lambda: sleeps(fleet, "idle") == 1, DEADLINE_S, 0.5, "an idle sleep")
    assert (sleeps(fleet, "operator"), sleeps(fleet, "pressure")) == (1, 1)
    woken_by_the_router(fleet, lone_tokens)


def test_a_sigkilled_member_is_restarted_with_nothing_leaked(fleet: Fleet,
                                                             lone_tokens) -> None:
    url = fleet.replicas("vl")[0]["url"]
    server = _server_pid(fleet)
    body = {"model": "vl", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body,
                      timeout=DEADLINE_S) as r:
        it = r.iter_lines()
        next(it)
        os.killpg(server, signal.SIGKILL)
        list(it)
    wait_for(lambda: "vl killed by SIGKILL; restarting it" in fleet.logs(), DEADLINE_S, 0.5,
             "the restart's line")
    wait_for(lambda: vl_state(fleet) == "awake", DEADLINE_S, 0.5, "vl back")
    assert tokens(fleet.url) == lone_tokens
    wait_for(lambda: cli(fleet, "check").returncode == 0, DEADLINE_S, 0.5, "check clean")
    assert fleet.replicas("vl")[0]["url"] != url
    # the fleet's looks (twice a second for minutes) never reached the member's log
    log = member_log(fleet)
    assert "GET /kvpool/sleep" not in log and "GET /is_sleeping" not in log
    assert "POST /v1/completions" in log  # (the rest of its access log is kept)


def _server_pid(f: Fleet) -> int:
    import psutil

    url = f.replicas("vl")[0]["url"]
    port = int(url.rsplit(":", 1)[1])
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    raise AssertionError(f"no process listens on {url}")
