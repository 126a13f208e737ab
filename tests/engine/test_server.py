"""`kvpool serve` as a real subprocess, driven by the OpenAI Python client and httpx."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .served import serving

openai = pytest.importorskip("openai")

NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(tiny_dir, log, "--served-model-name", NAME, "--num-kv-blocks", "256",
                 "--block-size", "8", "--max-model-len", "128", timeout_s=90) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_completion_matches_offline_engine(client, tiny_dir):
    from kvpool.engine import LLM, SamplingParams

    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.usage.model_extra["ttft_s"] > 0 and r.usage.model_extra["tpot_s"] > 0
    offline = LLM(str(tiny_dir), num_kv_blocks=64).generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert r.choices[0].text == offline.text


def test_streaming_chat_equals_non_streaming(client):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the cat."}]
    kw = dict(model=NAME, messages=msgs, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streaming_completion(client):
    stream = client.completions.create(model=NAME, prompt="The weather today is",
                                       max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_requests(client):
    def one(i):
        return client.completions.create(model=NAME, prompt=f"Question {i}: what is", seed=i,
                                         max_tokens=10, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(one, range(6)))
    assert all(o.usage.completion_tokens == 10 for o in outs)


def test_malformed_requests_get_4xx_and_server_keeps_serving(server, client):
    url = f"{server}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.post(url, json={"model": NAME}).status_code == 400  # no prompt
    assert httpx.post(url, json={"model": NAME, "prompt": "x", "n": 2}).status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=NAME, prompt=list(range(3, 203)), max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi", temperature=-2)
    r = client.completions.create(model=NAME, prompt="still alive?", max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_disconnect_aborts_and_stats(server, client):
    before = httpx.get(f"{server}/v1/stats").json()["finish_reasons"]
    stream = client.completions.create(model=NAME, prompt="Once", max_tokens=100,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.time() + 20
    while True:
        s = httpx.get(f"{server}/v1/stats").json()
        if s["running"] == 0 and s["waiting"] == 0:
            break
        assert time.time() < deadline, s
        time.sleep(0.1)
    assert s["kv_blocks"]["used"] == 0 and s["kv_blocks"]["total"] == 255
    # the request was aborted, not run to its 100 tokens
    assert s["finish_reasons"].get("abort", 0) == before.get("abort", 0) + 1, s["finish_reasons"]
    assert s["finish_reasons"].get("length", 0) == before.get("length", 0)
    assert {"preemptions", "ttft_s", "tpot_s", "finished_requests"} <= set(s)
    assert s["ttft_s"]["count"] > 0
    assert httpx.get(f"{server}/v1/stats").json()["model"] == NAME
