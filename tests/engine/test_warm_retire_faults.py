"""The old server's step loop (RetiringEngine) is never stuck by a handover that goes
wrong, and no client of it waits forever: a real engine in this process on a real daemon,
each fault staged by order (a patched call), not by timing.

* the ticket expires after the last request came: the step loop wakes and serves them
  all on (it must not wait on its empty inbox with requests to run);
* the daemon never tells the ticket's end: past its ttl (and a grace) the engine takes
  the offer back itself and serves on, every request (those that waited too) finishing
  exactly as before;
* settling raises: the step thread lives on, the pool's step lock is released, the moved
  and the waiting requests' clients hear of it at once (the moved one stays detached,
  never run twice), later requests are served.

Every wait has a deadline and fails with a line saying what did not happen."""

from __future__ import annotations

import asyncio
import time

import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from kvpool.client_lib import handoff as wire
from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine_adapters.bundled import Settings, enable, handoff_cache
from kvpool.elastic_server import warm_engine

from .test_pd_handoff import KV, prompt

LONG = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DEADLINE_S = 90.0  # generous: a stuck step thread fails the test with a line, not a hang
TTL_S = 2.0  # the offers that expire: ample for the waiting request to come first


@pytest.fixture
def aengine(start_daemon, tiny_dir):
    d = start_daemon(budget="8MiB")
    cfg = EngineConfig(model=str(tiny_dir), kv_cache_size=KV)
    bridge = enable(cfg, Settings(run_dir=str(d.run_dir), name="old", idle_timeout_s=600.0))
    e = warm_engine.RetiringEngine(Engine(bridge.config, bridge.seams))
    e.start()
    yield e
    e.stop()  # (the engine's integrity is checked after the test, conftest.py)


async def within(aw, what: str):
    try:
        return await asyncio.wait_for(aw, DEADLINE_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"{what}: not within {DEADLINE_S} s (stuck)") from None


async def rest(gen):
    """The last output of a generation (it must finish)."""
    out = None
    async for out in gen:
        pass
    assert out is not None and out.finished
    return out


async def held(aengine, n: int) -> None:
    """Until ``n`` requests wait for the handover (read from the step thread's list)."""
    deadline = time.monotonic() + DEADLINE_S
    while len(aengine._held) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} request(s) waiting for the handover: not within "
                                 f"{DEADLINE_S} s")
        await asyncio.sleep(0.01)


async def offer_mid_generation(aengine, ttl_s: float):
    """A long request decoding, then /pd/retire to a tenant nobody runs: its offer is out
    (the request detached), and a second request waits for it to settle."""
    gen = aengine.generate("a", prompt(130), LONG)
    first = await within(gen.__anext__(), "the first token")
    reply = await within(aengine.retire("nobody", ttl_s, True, "http://127.0.0.1:9"),
                         "the offer")
    assert [r["request_id"] for r in reply["cache"]["requests"]] == ["a"]
    late = asyncio.ensure_future(rest(aengine.generate("late", prompt(40), SHORT)))
    await held(aengine, 1)
    return gen, first, late, reply["cache"]


async def served_on(aengine, gen, first, late) -> None:
    """The moved request finishes here as if never offered, the waiting one too."""
    out = await within(rest(gen), "the moved request finishes here after all")
    assert (await within(late, "the request that waited is served")).finished
    again = await within(rest(aengine.generate("b", prompt(130), LONG)), "a rerun")
    assert out.output_token_ids == again.output_token_ids, "as if never offered"
    assert out.output_token_ids[:len(first.output_token_ids)] == first.output_token_ids


def test_an_expired_offer_wakes_the_step_loop(aengine):
    """Nothing is put on the inbox after the expiry (the waiting request came before):
    the step loop must not block on it with the requests it took back."""
    async def go():
        gen, first, late, _ = await offer_mid_generation(aengine, TTL_S)
        await served_on(aengine, gen, first, late)

    asyncio.run(go())


def test_an_offer_whose_end_is_never_told_is_taken_back(aengine, monkeypatch):
    monkeypatch.setattr(wire.Handoffs, "settled", lambda self, m: None)  # the word is lost
    monkeypatch.setattr(warm_engine, "SETTLE_GRACE_S", 0.5)

    async def go():
        gen, first, late, _ = await offer_mid_generation(aengine, TTL_S)
        await served_on(aengine, gen, first, late)

    asyncio.run(go())
    assert aengine.alive


def test_a_handover_that_raises_fails_its_clients_and_serves_on(aengine, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("staged fault")

    monkeypatch.setattr(handoff_cache, "settle_cache", broken)

    async def go():
        gen, _, late, c = await offer_mid_generation(aengine, 60.0)
        tenant = aengine.engine.pool.allocator.group.tenant
        assert await asyncio.to_thread(wire.cancel, tenant, c["ticket"])  # settles it now
        with pytest.raises(RuntimeError, match="warm restart failed: staged fault"):
            await within(rest(gen), "the moved request's client hears of it")
        with pytest.raises(RuntimeError, match="warm restart failed: staged fault"):
            await within(late, "the waiting request's client hears of it")
        monkeypatch.undo()
        out = await within(rest(aengine.generate("b", prompt(40), SHORT)),
                           "a request after the failure is served")
        assert len(out.output_token_ids) == SHORT.max_tokens

    asyncio.run(go())
    assert aengine.alive
    lock = aengine.engine.step_lock
    assert lock.acquire(timeout=DEADLINE_S), "the step lock is still held"
    lock.release()
    # where the moved request went is not known: it stays detached (its blocks kept,
    # never run twice); here it is known (cancelled), so the test takes it back
    aengine.stop()
    e = aengine.engine
    assert list(e.detached) == ["a"]
    e.reattach("a")
    e.abort("a")
