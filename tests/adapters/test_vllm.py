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
    # a generous reclaim deadline: the forced reclaim below waits for an engine step on
    # a machine that may be busy (the default 2 s would refuse the lease instead)
    d = start_daemon(budget="4MiB", page_size=65536, extra=("--reclaim-timeout", "60"))
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


# The tiny model's KV chunk (the release unit) is one 64 KiB page of each of its 2 layer
# regions: 8 blocks of 16 tokens. The lease leaves the server 2 chunks (the null block's
# and one: 15 usable blocks), fewer than 8 running requests hold once each has 4 blocks.
CHUNK = 2 * 65536
LEASE = (4 << 20) - 2 * CHUNK
RUNNING = 32 * 2 * 8192  # 32 blocks of 2 x 8 KiB: 4 per request, twice what the lease leaves


def _in_use(run_dir, name: str) -> int:
    from kvpool.client_lib import Monitor

    mon = Monitor(run_dir, timeout_s=30)
    try:
        return next((t.in_use for t in mon.ps().tenants if t.name == name), 0)
    finally:
        mon.close()


def _prewarmed_lease(run_dir) -> subprocess.Popen:
    """``kvpool lease LEASE -- sleep 2`` in an interpreter that has imported the CLI
    already, says ``ready`` on stdout then, and starts it when a line arrives on stdin
    (no interpreter start-up between the trigger and the lease under load)."""
    args = ["lease", str(LEASE), "--timeout", "60", "--run-dir", str(run_dir), "--",
            sys.executable, "-c", "import time; time.sleep(2)"]
    code = ("import sys; from kvpool.cli.main import cli; print('ready', flush=True); "
            f"sys.stdin.readline(); cli({args!r}, prog_name='kvpool')")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)


def test_greedy_output_equals_plain_vllm_even_under_a_forced_reclaim(servers, daemon):
    plain, elastic = servers
    want, _ = burst(plain.base, "plain")
    got, _ = burst(elastic.base, "tiny-a")
    assert got == want

    # Waits on events, not on timing: start from an empty prefix cache (the idle release
    # evicts it), so in_use is the running requests' blocks; a lease process that says it
    # is ready (imported, nothing left to load); lease once the requests hold twice what
    # the lease leaves. An attempt counts only if the engine itself says its shrink
    # preempted (its "kvpool: shrink of" line): the reclaim landed while requests ran.
    # Whether the HTTP responses had arrived says nothing about that (the API server
    # delivers them behind the engine core, further behind on a busy machine), and a run
    # that ended before the grant needs no preemption: that attempt is run again.
    def preempted(logs: str) -> list[int]:
        return [int(line.split("preempted ")[1].split()[0])
                for line in logs.splitlines() if line.startswith("kvpool: shrink of")]

    for _attempt in range(4):
        deadline = time.monotonic() + 120
        while _in_use(daemon.run_dir, "tiny-a") > 2 * CHUNK:
            assert time.monotonic() < deadline, daemon.ps()
            time.sleep(0.2)
        seen = len(preempted(elastic.logs()))
        lease = _prewarmed_lease(daemon.run_dir)
        try:
            assert lease.stdout.readline().strip() == "ready", lease.stderr.read()
            with ThreadPoolExecutor(len(PROMPTS)) as ex:
                futs = [ex.submit(complete, elastic.base, "tiny-a", p, MAX_TOKENS)
                        for p in PROMPTS]
                deadline = time.monotonic() + 300
                while (_in_use(daemon.run_dir, "tiny-a") < RUNNING
                       and not all(f.done() for f in futs)):
                    assert time.monotonic() < deadline, daemon.ps()
                    time.sleep(0.02)
                lease.stdin.write("go\n")
                lease.stdin.flush()
                err = lease.stderr.read()
                assert lease.wait(120) == 0, err
                assert "kvpool: leased" in err, err
                got = [tokens(f.result()) for f in futs]
        finally:
            if lease.poll() is None:
                lease.kill()
        assert got == want
        if sum(preempted(elastic.logs())[seen:]) > 0:
            break
    logs = elastic.logs()
    assert "kvpool: shrink of" in logs
    assert sum(preempted(logs)) > 0, ("no forced reclaim landed while the requests ran",
                                      logs[-3000:])


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
            # tensor parallelism on a daemon that serves one device (test_vllm_tp.py: two)
            (server_cmd(tiny_model, "x", 18995, ("--tensor-parallel-size", "2")),
             base_env(small.run_dir), "kvpool: tensor-parallel 2 needs one daemon device"),
            # more than one rank other than tensor parallelism
            (server_cmd(tiny_model, "x", 18993, ("--pipeline-parallel-size", "2")),
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
