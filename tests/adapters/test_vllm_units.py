"""vLLM CPU's KV in small allocation units (issue 36 item 5): SmolLM2-135M-Instruct served
by a real vLLM (``KVPOOL_ENABLE=1``) on a host daemon with 2 MiB pages, against a plain
vLLM of the same checkpoint.

vLLM lays SmolLM2's KV out layer-outer: 30 layer regions of 192 KiB pages (float32,
128-token blocks), so a unit was ``lcm(2 MiB, 192 KiB)`` = 6 MiB in each, 180 MiB. The
adapter interleaves the layers of a block in one region and pads the block (5760 KiB)
to 6 MiB: one block per unit, vLLM's own per-layer views over it, strided
(``engine_adapters/vllm/kv_units.py``). Asserted: greedy tokens equal plain vLLM's for
concurrent requests spanning several blocks (every layer's view lands on its own bytes);
``ps``'s ``chunk`` is a few pages; a request that wakes the sleeping server maps its
own blocks, the null block's and at most the reserve (``high``: 2 units), not 180 MiB
and more.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from .vllm_procs import (  # noqa: E402
    REPO,
    VllmServers,
    complete,
    remove_daemon,
    start_daemon,
)

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(1200)]
MIB = 1 << 20
PAGE = 2 * MIB
HIGH = 2  # the allocator's reserve watermark, in units (vllm Settings.high)
NAME = "smol"
PROMPTS = [f"Question {i}: name three rivers of Europe and say where each one flows. Answer:"
           for i in range(4)]
LONG = 200  # tokens: each request spans two 128-token blocks


def tokens(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def burst(base: str) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        return [tokens(f.result()) for f in
                [ex.submit(complete, base, NAME, p, LONG) for p in PROMPTS]]


def cli(run_dir, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", *args, "--run-dir",
                          str(run_dir)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out
    return out.stdout.strip()


def test_vllm_layers_interleaved_in_small_units_give_plain_vllms_tokens(
        smollm2_dir, tmp_path):
    d = start_daemon(budget="1GiB", page_size=PAGE, extra=("--warm-max", "0"))
    s = VllmServers(smollm2_dir, tmp_path)
    try:
        plain = s.start("plain", None, cpu=0)
        elastic = s.start(NAME, d.run_dir, cpu=1, KVPOOL_IDLE_TIMEOUT="600")
        s.wait_healthy(timeout=900)
        t = d.tenant(NAME)
        assert t is not None, d.ps()
        chunk = t["chunk"]
        assert 0 < chunk <= 4 * PAGE, f"an allocation unit of {chunk} B is not a few pages"
        assert "as 1 region(s)" in elastic.logs()  # the layers side by side

        want = [tokens(complete(plain.base, "plain", p, LONG)) for p in PROMPTS]
        assert burst(elastic.base) == want

        cli(d.run_dir, "sleep", NAME, "--wait", "120")
        t = d.tenant(NAME)
        assert (t["state"], t["mapped"]) == ("asleep", 0), t
        short = complete(elastic.base, NAME, PROMPTS[0], 8)  # wakes it, then is served
        assert tokens(short) == want[0][:8]
        woken = d.tenant(NAME)
        # the null block's unit and the request's (one 128-token block), and at most
        # the reserve; read now or later, never above
        blocks = 2
        assert 0 < woken["mapped"] <= (blocks + HIGH) * chunk, woken
        assert woken["mapped"] <= 24 * MIB, woken
    finally:
        s.close()
        remove_daemon(d)


from real_model import smollm2_dir  # noqa: E402, F401  (session fixture)
