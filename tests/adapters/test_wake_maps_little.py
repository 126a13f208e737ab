"""A wake maps what its first request needs (issue 36 item 5): a real ``kvpool serve
--elastic`` of SmolLM2-135M-Instruct on a host daemon with 2 MiB pages (what a GPU
imposes), put to sleep and woken by one short request.

SmolLM2's KV block (30 layers x K/V x 16 tokens x 3 heads x 64 x float32) is 720 KiB;
with the engine's own block an allocation unit was ``lcm(2 MiB, 720 KiB)`` = 90 MiB and a
wake mapped 3 of them (270 MiB: the null block's unit and a reserve of 2) for a request
that needs 2 blocks. The adapter pads the block to 768 KiB (1/16 unused): 6 MiB units of
8 blocks. And the wake itself maps only that unit: the allocator's reserve (``high``: 2
units) is not refilled after a wake until the engine's requests outgrow what is mapped
(``Refiller.disarm``/``arm``), so a short request's wake left 18 MiB mapped before and
6 MiB now. Asserted from ``ps`` (``kvpool ps --json``): the tenant's ``chunk`` is a few
pages, and after the wake, read once the request is answered and again after a second
one, it maps exactly one unit: the null block's, which holds the request's blocks.
(Fails with ``KVPOOL_KV_UNIT=exact`` or with the padding taken out of ``kv_unit.plan``:
a 90 MiB chunk, 270 MiB mapped; and with the ``disarm`` in ``allocator.suspend`` taken
out: 3 units, 18 MiB.)
"""

from __future__ import annotations

import httpx
import pytest

from daemon.helpers import wait_for

from .serve_procs import Servers

MIB = 1 << 20
PAGE = 2 * MIB
DEADLINE_S = 300.0
PROMPT = "The capital of France is"  # 6 tokens; with 8 generated: one 16-token block
MAX_TOKENS = 8

pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.timeout(900)]


def row(d, name: str) -> dict:
    rows = [t for t in d.cli_json("ps")["tenants"] if t["name"] == name]
    assert len(rows) == 1, rows
    return rows[0]


def ask(base: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_wake_maps_no_more_than_its_first_request_needs(smollm2_dir, start_daemon, tmp_path):
    d = start_daemon(budget="1GiB", page_size=PAGE, extra=("--warm-max", "0"))
    s = Servers(smollm2_dir, tmp_path)
    try:
        # a virtual KV capacity of many units; an idle timeout longer than the test, so
        # what a wake maps stays mapped while ps is read
        srv = s.start("smol", run_dir=d.run_dir, idle_timeout=600, kv_cache_size="512MiB")
        s.wait_healthy(DEADLINE_S)
        first = ask(srv.base)
        chunk = row(d, "smol")["chunk"]
        assert 0 < chunk <= 4 * PAGE, f"an allocation unit of {chunk} B is not a few pages"
        assert "KV cache: allocation unit" in srv.logs()

        r = httpx.post(f"{srv.base}/sleep", timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
        asleep = row(d, "smol")
        assert (asleep["state"], asleep["mapped"]) == ("asleep", 0), asleep

        again = ask(srv.base)  # wakes it, then is served
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        usage = again["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 16  # one block
        woken = wait_for(lambda: (x := row(d, "smol"))["state"] != "asleep" and x,
                         60, what="the woken server's state")
        # the null block and the request's block share one unit, and nothing else is
        # mapped for it: no reserve refilled by the wake
        assert woken["mapped"] == chunk <= 6 * MIB, woken
        assert woken["in_use"] <= chunk, woken
        ask(srv.base)  # a second short request: still within that unit, nothing grown
        later = row(d, "smol")
        assert later["mapped"] == chunk, later
    finally:
        s.close()


from real_model import smollm2_dir  # noqa: E402, F401  (session fixture)
