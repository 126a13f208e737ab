"""KV-level sleep of vLLM CPU as a kvpool tenant (issue 22, point 5): one real vLLM
server (``KVPOOL_ENABLE=1``, ``VLLM_SERVER_DEV_MODE=1`` for vLLM's own ``/sleep``,
``/wake_up``, ``/is_sleeping``) of the tiny Llama on a real daemon.

Asleep, the engine core's tenant holds 0 bytes (every KV page back, prefix cache reset);
waking by HTTP, by ``kvpool wake`` or by a request gives the same greedy tokens as
before sleeping; a request to a sleeping server (slept by HTTP or by ``kvpool sleep``)
is served.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from .vllm_procs import VllmServers, complete, remove_daemon, start_daemon  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NAME = "tiny-sleepy"
PROMPT = "Question 3: what is the weather like in the town by the river? Answer:"
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(budget="4MiB", page_size=65536)
    yield d
    remove_daemon(d)


@pytest.fixture(scope="module")
def server(tiny_model, daemon, tmp_path_factory):
    s = VllmServers(tiny_model, tmp_path_factory.mktemp("vllm-sleep-logs"))
    srv = s.start(NAME, daemon.run_dir, VLLM_SERVER_DEV_MODE="1")
    try:
        s.wait_healthy()
        yield srv
    finally:
        s.close()


def tokens(base: str) -> list[int]:
    return complete(base, NAME, PROMPT, 24)["choices"][0]["token_ids"]


def tenant(daemon) -> dict:
    t = daemon.tenant(NAME)
    assert t is not None, daemon.ps()
    return t


def asleep_holding_nothing(daemon) -> None:
    t = tenant(daemon)
    assert (t["state"], t["mapped"]) == ("asleep", 0), t


def is_sleeping(base: str) -> bool:
    return bool(httpx.get(f"{base}/is_sleeping", timeout=DEADLINE_S).json()["is_sleeping"])


def cli(daemon, *args: str) -> str:
    import subprocess
    import sys

    from .vllm_procs import REPO

    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", *args, "--run-dir",
                          str(daemon.run_dir)], capture_output=True, text=True,
                         timeout=DEADLINE_S, cwd=REPO)
    assert out.returncode == 0, out
    return out.stdout.strip()


def test_kv_level_sleep_and_wake(server, daemon):
    before = tokens(server.base)
    assert tenant(daemon)["mapped"] > 0 and not is_sleeping(server.base)

    r = httpx.post(f"{server.base}/sleep", timeout=DEADLINE_S)
    assert (r.status_code, r.json()) == (200, {"status": "sleeping", "level": 1}), r.text
    assert is_sleeping(server.base)
    asleep_holding_nothing(daemon)
    r = httpx.post(f"{server.base}/wake_up", timeout=DEADLINE_S)
    assert (r.status_code, r.json()["status"]) == (200, "awake"), r.text
    assert not is_sleeping(server.base)
    assert tokens(server.base) == before  # the first request after waking

    # slept by HTTP, woken by a request
    assert httpx.post(f"{server.base}/sleep", timeout=DEADLINE_S).status_code == 200
    asleep_holding_nothing(daemon)
    assert tokens(server.base) == before
    assert not is_sleeping(server.base)

    # by the CLI (the tenant's handler in the engine core), woken by the CLI, then by a
    # request
    assert cli(daemon, "sleep", NAME, "--wait", "60") == f"{NAME}: asleep"
    asleep_holding_nothing(daemon)
    assert is_sleeping(server.base)
    assert cli(daemon, "wake", NAME, "--wait", "60") == f"{NAME}: awake"
    assert tokens(server.base) == before
    assert cli(daemon, "sleep", NAME, "--wait", "60") == f"{NAME}: asleep"
    asleep_holding_nothing(daemon)
    assert tokens(server.base) == before
    assert tenant(daemon)["state"] != "asleep" and not is_sleeping(server.base)
