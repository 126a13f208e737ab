"""The engine's /metrics: Prometheus text with vLLM's names, scraped with
prometheus_client's own parser while requests run; its counters and histograms follow
the requests served exactly; /v1/stats stays JSON."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from engine.conftest import tiny_dir  # noqa: F401  (the tiny model fixture)

from .helpers import free_port, samples, scrape, value

openai = pytest.importorskip("openai")
NAME = "tiny"
VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
              "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
              "vllm:e2e_request_latency_seconds_count", "kvpool_engine_kv_held_bytes")


@pytest.fixture
def served(tiny_dir, tmp_path):  # noqa: F811
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "serve", str(tiny_dir), "--port",
             str(port), "--served-model-name", NAME, "--num-kv-blocks", "256",
             "--block-size", "8", "--max-model-len", "128", "--log-level", "warning"],
            stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_engine_metrics_follow_the_requests(served):
    port = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    before = scrape(port)
    for name in VLLM_NAMES:
        assert samples(before, name), name
    stream = client.completions.create(model=NAME, prompt="Once upon", max_tokens=60,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    during = scrape(port)  # while a request runs
    assert value(during, "vllm:num_requests_running", model_name=NAME) >= 1
    assert value(during, "vllm:kv_cache_usage_perc", model_name=NAME) > 0
    for _ in it:
        pass
    prompt = generated = 0
    for i in range(4):
        r = client.completions.create(model=NAME, prompt=f"tell me {i}", max_tokens=5,
                                      extra_body={"ignore_eos": True})
        prompt += r.usage.prompt_tokens
        generated += r.usage.completion_tokens
    after = scrape(port)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    for key in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                "vllm:time_per_output_token_seconds_count"):
        assert delta(key, model_name=NAME) == 5, key
    assert sum(samples(after, "vllm:request_success_total").values()) - \
        sum(samples(before, "vllm:request_success_total").values()) == 5
    assert delta("vllm:generation_tokens_total", model_name=NAME) == generated + 60
    assert delta("vllm:prompt_tokens_total", model_name=NAME) >= prompt
    for (name, labels), v in before.items():
        if name.endswith(("_total", "_count", "_sum", "_bucket")):
            assert after[(name, labels)] >= v, name
    stats = httpx.get(f"http://127.0.0.1:{port}/v1/stats").json()  # still JSON
    assert stats["model"] == NAME
    assert value(after, "vllm:num_requests_running", model_name=NAME) == stats["running"] == 0
    assert value(after, "vllm:prompt_tokens_total", model_name=NAME) == stats["prompt_tokens"]
    assert value(after, "kvpool_engine_kv_held_bytes", model_name=NAME) == stats["kv_held_bytes"]


def test_an_elastic_engine_exports_its_grants_next_to_the_daemon(start_daemon, tmp_path):
    from adapters.serve_procs import Servers, complete, prompt

    from kvpool.engine.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", layers=2, hidden=128, heads=4, kv_heads=2,
                            vocab=512, seed=0)
    dport = free_port()
    d = start_daemon(budget="8MiB", extra=("--metrics-address", f"127.0.0.1:{dport}"))
    servers = Servers(model, tmp_path)
    try:
        s = servers.start("m1", run_dir=d.run_dir, idle_timeout=30.0)
        servers.wait_healthy(120)
        r = complete(s.base, prompt(1, 64), 64)
        assert r.status_code == 200, r.text
        engine = scrape(s.port)
        daemon = scrape(dport)
        grants = value(engine, "kvpool_engine_elastic_grants_total", model_name="m1")
        assert grants >= 1
        assert value(daemon, "kvpool_grants_total") >= grants  # the daemon served them all
        assert samples(engine, "kvpool_engine_elastic_waits_total")
        assert value(daemon, "kvpool_tenant_mapped_bytes", tenant="m1") > 0
        assert value(engine, "kvpool_engine_kv_held_bytes", model_name="m1") > 0
    finally:
        servers.close()
