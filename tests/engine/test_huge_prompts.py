"""Huge prompts against a real ``kvpool serve`` (issue 33, item 3: a 30 MiB prompt was
tokenized in full before the length check — a minute during which every other request
waited, and the server 4 GB larger for good).

A prompt is bounded before it is tokenized: a body past the server's limit (derived from
``max_model_len``) is a 413 before it is read; a prompt of more characters than the
context could hold (:data:`~kvpool.engine.tokenizer.MAX_CHARS_PER_TOKEN` per token) is a
400 saying so, never tokenized. Outcomes only: the statuses and messages, the server's
resident memory, a small request served beside the big ones."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvpool import launch
from kvpool.engine.serving.body_limit import body_limit
from kvpool.engine.tokenizer import MAX_CHARS_PER_TOKEN

from .served import free_port

MAX_MODEL_LEN = 64
RSS_GROWTH = 192 << 20  # what a handful of refused prompts may leave behind, at most


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory) -> Iterator[tuple[str, int, Path]]:
    log = tmp_path_factory.mktemp("huge") / "serve.log"
    port = free_port()
    proc = launch.spawn_process([*launch.cli_argv(), "serve", str(tiny_dir), "--port",
                                 str(port), "--log-level", "warning", "--num-kv-blocks",
                                 "64", "--block-size", "8", "--max-model-len",
                                 str(MAX_MODEL_LEN)], log)
    base = f"http://127.0.0.1:{port}"
    try:
        launch.wait_healthy(proc, base, "kvpool serve", time.monotonic() + 120,
                            logs=lambda: log.read_text())
        yield base, proc.pid, log
    finally:
        launch.stop(proc, grace_s=15)


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert m is not None, status
    return int(m.group(1)) << 10


def post(base: str, route: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}{route}", content=body, timeout=300,
                      headers={"content-type": "application/json"})


def small(base: str) -> httpx.Response:
    return post(base, "/v1/completions", json.dumps(
        {"prompt": "Once upon", "max_tokens": 2}).encode())


def test_a_prompt_past_the_character_bound_is_refused_untokenized(server):
    base, pid, log = server
    limit = MAX_CHARS_PER_TOKEN * MAX_MODEL_LEN
    assert small(base).status_code == 200  # warm: what serving costs is paid before
    before = rss(pid)
    text = "ab " * (body_limit(MAX_MODEL_LEN) // 3 - 100)  # under the body limit
    for route, body in (
            ("/v1/completions", {"prompt": text, "max_tokens": 2}),
            ("/v1/completions", {"prompt": ["hi", text], "max_tokens": 2}),
            ("/v1/completions", {"prompt": text, "max_tokens": 2, "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        with ThreadPoolExecutor(5) as ex:  # four of them at once, and a small one beside
            big = [ex.submit(post, base, route, json.dumps(body).encode()) for _ in range(4)]
            assert small(base).status_code == 200
            for f in big:
                r = f.result()
                assert r.status_code == 400, (route, r.status_code, r.text[:300])
                msg = r.json()["error"]["message"]
                assert "\n" not in msg and "characters" in msg and str(limit) in msg, msg
    assert rss(pid) - before < RSS_GROWTH, (before, rss(pid))
    assert "Traceback" not in log.read_text()


def test_a_body_past_the_limit_is_a_413_before_it_is_read(server):
    base, pid, log = server
    assert small(base).status_code == 200
    before = rss(pid)
    prompt = "x" * (30 << 20)  # 30 MiB: under the fleet's 32 MiB, far past this server's
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    for route in ("/v1/completions", "/v1/chat/completions"):
        r = post(base, route, body)
        assert r.status_code == 413, (route, r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "\n" not in msg and str(body_limit(MAX_MODEL_LEN)) in msg, msg

    def chunks() -> Iterator[bytes]:  # no declared length: counted as it is read
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]

    r = httpx.post(f"{base}/v1/completions", content=chunks(), timeout=300,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, (r.status_code, r.text[:300])
    assert small(base).status_code == 200
    assert rss(pid) - before < RSS_GROWTH, (before, rss(pid))
    assert "Traceback" not in log.read_text()
