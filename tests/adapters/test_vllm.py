"""vLLM (CPU build) as a kvpool tenant: real vLLM servers, a real daemon, host memory.

One plain server and one ``KVPOOL_ENABLE=1`` server on the same tiny Llama are shared by
the tests of this module (each start costs tens of seconds on two cores).
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from .vllm_procs import (  # noqa: E402
    PROMPTS,
    REPO,
    VllmServers,
    base_env,
    complete,
    remove_daemon,
    run_fails,
    server_cmd,
    start_daemon,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MAX_TOKENS = 300  # 8 requests x 3 blocks of 128 tokens: about half the 4 MiB budget


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(budget="4MiB", page_size=65536)
    yield d
    remove_daemon(d)


@pytest.fixture(scope="module")
def servers(tiny_model, daemon, tmp_path_factory):
    s = VllmServers(tiny_model, tmp_path_factory.mktemp("vllm-logs"))
    plain = s.start("plain", None, cpu=0)
    elastic = s.start("tiny-a", daemon.run_dir, cpu=1)
    try:
        s.wait_healthy()
        yield plain, elastic
    finally:
        s.close()


def tokens(resp: dict) -> list:
    ch = resp["choices"][0]
    return ch.get("token_ids") or ch["text"]


def burst(base: str, model: str, during=None) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        futs = [ex.submit(complete, base, model, p, MAX_TOKENS) for p in PROMPTS]
        extra = during() if during else None
        return [tokens(f.result()) for f in futs], extra


def test_ps_lists_the_server_as_an_engine_tenant(servers, daemon):
    _, elastic = servers
    t = daemon.tenant("tiny-a")
    assert t is not None, daemon.ps()
    assert t["kind"] == "engine"
    assert t["pid"] in elastic.engine_pids()  # the engine core holds the KV cache
    logs = elastic.logs()
    assert "registered as tenant 'tiny-a'" in logs
    assert "plugin active" in logs


def test_greedy_output_equals_plain_vllm_even_under_a_forced_reclaim(servers, daemon):
    plain, elastic = servers
    want, _ = burst(plain.base, "plain")
    got, _ = burst(elastic.base, "tiny-a")
    assert got == want

    def lease_mid_generation():
        deadline = time.monotonic() + 120
        while (daemon.tenant("tiny-a") or {}).get("in_use", 0) < (1 << 20):
            assert time.monotonic() < deadline, daemon.ps()
            time.sleep(0.05)
        return subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "lease", "3MiB", "--timeout", "60",
             "--run-dir", str(daemon.run_dir), "--", sys.executable, "-c",
             "import time; time.sleep(2)"], capture_output=True, text=True, cwd=REPO,
            timeout=180)

    got, lease = burst(elastic.base, "tiny-a", lease_mid_generation)
    assert lease.returncode == 0, lease.stderr
    assert got == want
    logs = elastic.logs()
    assert "kvpool: shrink of" in logs
    preempted = [int(line.split("preempted ")[1].split()[0])
                 for line in logs.splitlines() if line.startswith("kvpool: shrink of")]
    assert sum(preempted) > 0, logs[-3000:]


def test_prefix_cache_still_hits_under_elastic_kv(servers):
    _, elastic = servers
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # > 2 blocks
    first = complete(elastic.base, "tiny-a", prompt, 8)
    second = complete(elastic.base, "tiny-a", prompt, 8)
    assert tokens(first) == tokens(second)
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached >= 128, second["usage"]


def _one_line_refusal(proc: subprocess.CompletedProcess, starts: str) -> None:
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert err and err[-1].startswith(starts), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_bad_starts_are_one_line_errors(tiny_model, tmp_path):
    small = start_daemon(budget="64KiB", page_size=65536)
    try:
        cases = [
            # no daemon at the run directory
            (server_cmd(tiny_model, "x", 18991), base_env(tmp_path / "none"),
             "kvpool: no kvpool daemon answers"),
            # a budget that cannot hold one chunk of this model's KV blocks
            (server_cmd(tiny_model, "x", 18992), base_env(small.run_dir),
             "kvpool: the daemon's budget"),
            # more than one rank
            (server_cmd(tiny_model, "x", 18993, ("--tensor-parallel-size", "2")),
             base_env(small.run_dir), "kvpool: KVPOOL_ENABLE=1 serves one rank"),
            # a vLLM version outside the tested range (the same server, version renamed)
            ([sys.executable, "-c",
              "import runpy, sys, vllm; vllm.__version__ = '0.31.9'; sys.argv[0] = 'api';"
              "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__')",
              *server_cmd(tiny_model, "x", 18994)[3:]], base_env(small.run_dir),
             "kvpool: vLLM 0.31.9 is not a version"),
        ]
        with ThreadPoolExecutor(2) as ex:
            results = list(ex.map(lambda c: run_fails(c[0], c[1]), cases))
        for (_, _, starts), proc in zip(cases, results):
            _one_line_refusal(proc, starts)
    finally:
        remove_daemon(small)
