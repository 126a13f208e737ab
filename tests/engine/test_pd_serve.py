"""`kvpool serve --role prefill` + `kvpool serve --role decode --prefill-url ...` as real
processes on a real daemon: the decode server is the OpenAI front; every request is
prefilled by the other process and its KV handed over as pages. Greedy tokens equal a
single engine's (plain and streamed), the handoffs happened (no recompute), and both
tenants end with nothing in use and `kvpool check` clean."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import REPO
from kvpool import launch

from .test_pd_handoff import GREEDY, KV, LENGTHS, prompt, reference  # noqa: F401 (fixture)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(d, model, log, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
           "KVPOOL_RUN_DIR": str(d.run_dir), "PYTHONPATH": str(REPO)}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "serve", str(model), "--port",
             str(port), "--kv-cache-size", KV, "--log-level", "warning", *args],
            stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    d.workers.append(proc)
    return proc, f"http://127.0.0.1:{port}"


def healthy(proc, base: str, log) -> None:
    launch.wait_healthy(proc, base, "server", time.monotonic() + 120, logs=log.read_text)


def body(n: int, **kw) -> dict:
    return {"prompt": prompt(n), "max_tokens": GREEDY["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **kw}


def stream_choices(r: httpx.Response):
    """The choices of each server-sent chunk of a streamed completion (none may be an
    error)."""
    assert r.status_code == 200
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk["choices"]


def streamed(base: str, n: int) -> list[int]:
    tokens: list[int] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body(n, stream=True),
                      timeout=120) as r:
        for choices in stream_choices(r):
            for c in choices:
                tokens += c.get("token_ids", [])
    return tokens


def test_a_served_pair_equals_a_single_engine(start_daemon, tiny_dir, reference, tmp_path):
    d = start_daemon(budget="8MiB")
    pre, pre_url = serve(d, tiny_dir, tmp_path / "prefill.log", "--role", "prefill",
                         "--served-model-name", "tiny")
    dec, url = serve(d, tiny_dir, tmp_path / "decode.log", "--role", "decode",
                     "--served-model-name", "tiny", "--prefill-url", pre_url)
    healthy(pre, pre_url, tmp_path / "prefill.log")
    healthy(dec, url, tmp_path / "decode.log")
    for n in LENGTHS:
        r = httpx.post(f"{url}/v1/completions", json=body(n), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference[n], f"prompt of {n}"
    for n in (5, 130):
        assert streamed(url, n) == reference[n], f"streamed prompt of {n}"
    # a request the prefill engine finishes (its first token is its last): no handoff
    r = httpx.post(f"{url}/v1/completions", json=body(40, max_tokens=1), timeout=120)
    assert r.json()["choices"][0]["token_ids"] == reference[40][:1], r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
    assert stats["pd"] == {"adopted": len(LENGTHS) + 2, "recomputed": 0}
    held = {t["name"]: t for t in d.cli_json("ps")["tenants"]}
    assert set(held) == {"tiny-prefill", "tiny-decode"}
    for base in (pre_url, url):  # nothing held but the null block on either side
        assert httpx.get(f"{base}/v1/stats", timeout=10).json()["kv_blocks"]["used"] == 0
    assert d.check() == []
    # the prefill server is gone: the front computes requests itself, same tokens
    pre.kill()
    pre.wait()
    r = httpx.post(f"{url}/v1/completions", json=body(65), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference[65]
    assert httpx.get(f"{url}/v1/stats", timeout=10).json()["pd"]["recomputed"] == 1
    assert d.check() == []


def test_serve_pd_runs_both_halves_in_one_command(start_daemon, tiny_dir, reference,
                                                 tmp_path):
    d = start_daemon(budget="8MiB")
    log = tmp_path / "pd.log"
    front, url = serve(d, tiny_dir, log, "--pd", "--served-model-name", "tiny")
    healthy(front, url, log)
    for n in (5, 65, 130):
        r = httpx.post(f"{url}/v1/completions", json=body(n), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference[n], f"prompt of {n}"
    assert httpx.get(f"{url}/v1/stats", timeout=10).json()["pd"]["adopted"] == 3
    names = {t["name"]: t["pid"] for t in d.cli_json("ps")["tenants"]}
    assert set(names) == {"tiny-prefill", "tiny-decode"}
    assert names["tiny-decode"] == front.pid != names["tiny-prefill"]  # two processes
    front.terminate()
    front.wait(30)
    deadline = time.monotonic() + 30  # the prefill child ends with the front
    while d.cli_json("ps")["tenants"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert d.cli_json("ps")["tenants"] == []
    assert d.check() == []


def test_bad_pd_options_are_one_clear_line(tiny_dir):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvpool.cli.main", "serve", str(tiny_dir),
                               *args], capture_output=True, text=True, timeout=120, cwd=REPO)

    for args, says in ((("--role", "decode"), "--prefill-url"),
                       (("--handoff-from", "http://127.0.0.1:9"), "--elastic"),
                       (("--role", "sideways"), "sideways")):
        out = cli(*args)
        assert out.returncode != 0 and says in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr
