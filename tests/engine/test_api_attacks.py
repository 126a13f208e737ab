"""Hostile sampling values against a real `kvpool serve` (issue 24, defect 5): every field
of /v1/completions and /v1/chat/completions is checked like vLLM checks it, and a bad
value gets a 400 whose one-line message names the field, never a 500 and never a silent
acceptance (``top_k: 10**9``); values at the edges of the ranges are served."""

from __future__ import annotations

import math

import httpx
import pytest

from .served import serving

NAME = "tiny"
BIG = 2 ** 70

# (field, value): each must be refused with a 400 naming the field, on both routes
BAD: list[tuple[str, object]] = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5),
    ("temperature", 2.5), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", -math.inf),
    ("top_k", -5), ("top_k", 10 ** 9), ("top_k", BIG), ("top_k", 1.5),
    ("seed", BIG), ("seed", -BIG), ("seed", 2 ** 63), ("seed", "x"),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", BIG),
    ("n", 0), ("n", 2), ("n", BIG),
    ("stop", [""]), ("stop", 5), ("stop", [1]), ("stop", ["a"] * 100),
    ("stop_token_ids", [-1]), ("stop_token_ids", [BIG]), ("stop_token_ids", "x"),
    ("ignore_eos", [1]),
    ("presence_penalty", 3.0), ("presence_penalty", 0.5), ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1.3),
    ("min_p", 1.5), ("min_p", 0.2), ("min_tokens", -1), ("min_tokens", 4),
    ("logit_bias", {"5": 100}), ("best_of", 3), ("user", 5),
    ("stream_options", {"include_usage": "lots"}), ("stream_options", 5),
    ("stream", "sometimes"), ("model", 7),
]
COMPLETION_ONLY: list[tuple[str, object]] = [
    ("logprobs", -3), ("logprobs", 5), ("echo", True), ("suffix", "x"),
]
CHAT_ONLY: list[tuple[str, object]] = [
    ("logprobs", True), ("top_logprobs", 3), ("top_logprobs", -1),
    ("max_completion_tokens", 0), ("max_completion_tokens", BIG),
]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("api-attacks") / "serve.log"
    with serving(tiny_dir, log, "--served-model-name", NAME, "--num-kv-blocks", "64",
                 "--block-size", "8", "--max-model-len", "64", timeout_s=120) as base:
        yield base
    assert "Traceback" not in log.read_text()


def completion(**kw: object) -> dict:
    return {"model": NAME, "prompt": "Once upon", "max_tokens": 2, **kw}


def chat(**kw: object) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **kw}


def post(server: str, route: str, body: dict) -> httpx.Response:
    import json

    # json.dumps writes NaN/Infinity literals, as a hostile client can
    return httpx.post(f"{server}{route}", content=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=60)


def refused(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, (field, r.status_code, r.text)
    msg = r.json()["error"]["message"]
    assert field in msg and "\n" not in msg, (field, msg)


@pytest.mark.parametrize("field,value", BAD + COMPLETION_ONLY,
                         ids=lambda x: repr(x)[:24])
def test_a_bad_completion_field_is_a_400_naming_it(server, field, value):
    refused(post(server, "/v1/completions", completion(**{field: value})), field)


@pytest.mark.parametrize("field,value", BAD + CHAT_ONLY, ids=lambda x: repr(x)[:24])
def test_a_bad_chat_field_is_a_400_naming_it(server, field, value):
    refused(post(server, "/v1/chat/completions", chat(**{field: value})), field)


def test_bad_prompts_and_messages_are_400s(server):
    for prompt in ([], [[]], [-1], [BIG], [[1, 2], "x"], 5, None, [1.5]):
        r = post(server, "/v1/completions", completion(prompt=prompt))
        assert r.status_code == 400 and "prompt" in r.text, (prompt, r.text)
    for messages in ([], 5, [5], [{"role": 5, "content": "x"}], [{"content": "x"}]):
        r = post(server, "/v1/chat/completions", chat(messages=messages))
        assert r.status_code == 400, (messages, r.text)


def test_values_at_the_edges_are_served(server):
    for kw in ({"temperature": 0.0}, {"temperature": 2.0, "seed": 2 ** 63 - 1},
               {"seed": -2 ** 63, "temperature": 1.0}, {"top_k": -1}, {"top_k": 0},
               {"top_p": 1.0, "top_k": 1}, {"presence_penalty": 0.0, "logprobs": None},
               {"stop": ["zz"], "stop_token_ids": [0]}, {"n": 1, "best_of": 1}):
        r = post(server, "/v1/completions", completion(**kw))
        assert r.status_code == 200, (kw, r.text)
    r = post(server, "/v1/chat/completions", chat(logprobs=False, top_logprobs=0))
    assert r.status_code == 200, r.text


def test_deeply_nested_bodies_are_400s_with_one_line(server):
    """JSON nested deeper than the parser goes (issue 33 item 10), bare or in a field the
    server reads (``prompt``, ``messages``, ``stop``), and nested just under that depth:
    a 400 in OpenAI's shape, one line, never a 500."""
    deep = b"[" * 100_000
    under = b"[" * 900 + b"1" + b"]" * 900
    for route, body in (("/v1/completions", deep),
                        ("/v1/completions", b'{"model": "tiny", "prompt": ' + deep),
                        ("/v1/completions", b'{"model": "tiny", "prompt": ' + under + b"}"),
                        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "stop": '
                         + under + b"}"),
                        ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + deep),
                        ("/v1/chat/completions", b'{"model": "tiny", "messages": '
                         + under + b"}")):
        r = httpx.post(f"{server}{route}", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (route, body[:40], r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "\n" not in msg, msg
