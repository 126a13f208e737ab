"""Pure unit tests: protocol codecs and bounds, the page pool, the arbiter's invariants."""

from __future__ import annotations

import mmap
import socket

import msgspec
import pytest

from kvpool import paths
from kvpool import protocol as p
from kvpool.daemon.arbiter import Arbiter
from kvpool.daemon.config import Config, TenantPolicy
from kvpool.daemon.pool import PoolExhausted, Pool
from kvpool.vmm.host import HostBackend

PAGE = 64 << 10


# ---- protocol ----------------------------------------------------------------------
@pytest.mark.parametrize("req", [
    p.Register(id=1, token="t", name="llama-8b", kind="engine", device=0),
    p.CreateGroup(id=2, n_regions=64, capacity=1 << 30, bases=[1 << 40] * 64, label="kv",
                  chunk_units=3),
    p.DestroyGroup(id=3, group=7),
    p.Grant(id=4, group=1, units=[0, 1, 2], in_use=0, reserve=[2]),
    p.Release(id=5, group=1, units=[1]),
    p.Report(id=6, group=1, reserve=[]),
    p.Bye(id=7), p.Ping(id=8), p.Ps(id=9), p.Stats(id=10),
    p.MapReq(id=11, tenant="x", pfns=True), p.SetLimit(id=12, tenant="x", max=1 << 30),
    p.Check(id=13), p.SetLimit(id=14, tenant="x", shares=2.5),
    p.Register(id=15, token="t", name="x", kind="lease", shares=p.MAX_SHARES),
    p.TenantState(id=16, state="asleep", reason="pressure"),
])
def test_every_request_round_trips(req):
    assert p.decode_request(p.encode(req)) == req
    assert isinstance(msgspec.msgpack.decode(p.encode(req)), dict)  # maps on the wire


def test_replies_round_trip_and_errors_have_codes():
    for reply in (p.error(3, p.NO_MEMORY, "full"), p.Done(id=1),
                  p.Granted(id=2, group=1, units=[1], nfds=4), p.Reclaim(bytes=10)):
        assert p.decode_reply(p.encode(reply)) == reply
    assert p.decode_reply(p.encode(p.error(3, p.BUSY, "x"))).ok is False
    with pytest.raises(AssertionError):
        p.error(1, "NOPE", "unknown codes are a bug")


@pytest.mark.parametrize("obj,rid", [
    ({"op": "grant", "id": 5, "group": 1, "units": list(range(p.MAX_UNITS + 1))}, 5),
    ({"op": "grant", "id": 6, "group": 1, "units": [p.MAX_PAGES_PER_REGION]}, 6),
    ({"op": "create_group", "id": 7, "n_regions": p.MAX_REGIONS + 1, "capacity": 1}, 7),
    ({"op": "create_group", "id": 8, "n_regions": 1, "capacity": p.MAX_BYTES + 1}, 8),
    ({"op": "register", "id": 9, "name": "x" * (p.MAX_NAME + 1)}, 9),
    ({"op": "register", "id": 10, "name": "bad name"}, 10),
    ({"op": "register", "id": 11, "name": "x", "kind": "root"}, 11),
    ({"op": "ps", "id": 12, "surprise": 1}, 12),
    # version 3: the fair-share knob is ``shares``; the old field is unknown on the wire
    ({"op": "register", "id": 14, "name": "x", "weight": 2.0}, 14),
    ({"op": "set_limit", "id": 15, "tenant": "x", "weight": 2.0}, 15),
    ({"op": "set_limit", "id": 16, "tenant": "x", "shares": p.MAX_SHARES * 2}, 16),
    ({"op": "set_limit", "id": 17, "tenant": "x", "shares": 0}, 17),
    # Literal states: a state or reason outside the alias is refused like any bad field
    ({"op": "tenant_state", "id": 18, "state": "dozing"}, 18),
    ({"op": "tenant_state", "id": 19, "state": "awake"}, 19),  # (shown by ps, never said)
    ({"op": "tenant_state", "id": 20, "state": "idle", "reason": "boredom"}, 20),
    ({"op": "teleport", "id": 13}, 13),
    ({"op": "ps", "id": -1}, 0),
    ({"op": "ps", "id": True}, 0),
    ([1, 2, 3], 0),
])
def test_invalid_requests_raise_decode_error_with_salvaged_id(obj, rid):
    with pytest.raises(p.DecodeError) as e:
        p.decode_request(p.encode(obj))
    assert e.value.id == rid and e.value.code == p.BAD_REQUEST


@pytest.mark.parametrize("reply", [
    {"r": "reclaim", "bytes": 1, "mode": "grow"},
    {"r": "settled", "ticket": "t", "state": "lost", "group": 1, "units": []},
    {"r": "weights", "group": 0, "units": [], "nfds": 0, "state": "melting"},
    {"r": "ps", "tenants": [{"id": 1, "name": "x", "kind": "engine", "pid": 1, "uid": 0,
                             "registered": True, "groups": 0, "mapped": 0, "in_use": 0,
                             "reserve": 0, "min": 0, "max": 0, "shares": 1.0,
                             "state": "dozing"}]},
    {"r": "ps", "tenants": [{"id": 1, "name": "x", "kind": "root", "pid": 1, "uid": 0,
                             "registered": True, "groups": 0, "mapped": 0, "in_use": 0,
                             "reserve": 0, "min": 0, "max": 0, "shares": 1.0}]},
])
def test_a_reply_with_an_unknown_state_or_kind_is_refused(reply):
    """The daemon's states and kinds are Literal types: a client refuses a value outside
    them (a daemon of another version would say VERSION first)."""
    with pytest.raises(msgspec.ValidationError):
        p.decode_reply(p.encode(reply))


def test_literal_states_decode_and_show_in_ps():
    info = {"id": 1, "name": "", "kind": "", "pid": 1, "uid": 0, "registered": False,
            "groups": 0, "mapped": 0, "in_use": 0, "reserve": 0, "min": 0, "max": 0,
            "shares": 2.0, "fair_share": 5}
    got = p.decode_reply(p.encode({"r": "ps", "tenants": [info]}))
    assert isinstance(got, p.PsReply)
    (t,) = got.tenants
    assert (t.kind, t.state, t.shares, t.fair_share) == ("", "awake", 2.0, 5)
    assert p.SLEEP_STATES == ("busy", "idle", "asleep")
    assert p.SETTLED_STATES == ("claimed", "expired", "cancelled")
    for state in p.SETTLED_STATES:
        s = p.Settled(ticket="t", state=state, group=1, units=[2])
        assert p.decode_reply(p.encode(s)) == s


def test_oversized_frame_is_rejected_before_decoding():
    with pytest.raises(p.DecodeError, match="exceeds"):
        p.decode_request(b"\x80" * (p.MAX_FRAME + 1))


# ---- paths -------------------------------------------------------------------------
def test_run_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOOL_RUN_DIR", str(tmp_path / "env"))
    assert paths.run_dir("/explicit") == paths.Path("/explicit")
    assert paths.run_dir() == tmp_path / "env"
    monkeypatch.delenv("KVPOOL_RUN_DIR")
    monkeypatch.setattr(paths, "SYSTEM_RUN_DIR", str(tmp_path / "missing"))
    monkeypatch.setattr(paths.os, "geteuid", lambda: 1000)  # root never falls back
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.run_dir() == tmp_path / "kvpool"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(paths.run_dir()).startswith("/tmp/kvpool-")
    (tmp_path / "sys").mkdir()
    monkeypatch.setattr(paths, "SYSTEM_RUN_DIR", str(tmp_path / "sys"))
    assert paths.run_dir() == tmp_path / "sys"


# ---- config ------------------------------------------------------------------------
def test_config_load_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('budget = "1GiB"\nwarm_max = "16p"\n[tenants.a]\nmax = "50%"\nshares = 2.0\n')
    cfg = Config.load(f, budget="2GiB", page_size=None)
    assert cfg.budget == "2GiB" and cfg.tenants["a"] == TenantPolicy(max="50%", shares=2.0)
    assert cfg.resolve_pages(cfg.warm_max, PAGE, 1 << 30) == 16
    assert cfg.resolve_pages("1MiB", PAGE, 1 << 30) == 16
    f.write_text("colour = 'blue'\n")
    with pytest.raises(ValueError, match="unknown configuration keys: colour"):
        Config.load(f)
    f.write_text("[tenants.a]\nmaxx = 1\n")
    with pytest.raises(ValueError, match="unknown keys maxx"):
        Config.load(f)


# ---- pool --------------------------------------------------------------------------
@pytest.fixture
def backend():
    b = HostBackend(page_size=PAGE)
    yield b
    b.close()


def _fill(backend, page, byte: int) -> bytes:
    with mmap.mmap(page.handle, PAGE) as m:
        m[:] = bytes([byte]) * PAGE
        return m[:16]


def _read(page) -> bytes:
    with mmap.mmap(page.handle, PAGE) as m:
        return m[:]


def test_pool_budget_zeroing_and_integrity(backend):
    pool = Pool(backend, budget_pages=4, warm_min=0, warm_max=2)
    a = pool.take(3, tenant=1)
    assert pool.granted == 3 and pool.free == 1 and pool.check() == []
    with pytest.raises(PoolExhausted):
        pool.take(2, tenant=2)
    for pfn in a:
        _fill(backend, pool.pages[pfn], 0xCD)
    pool.give_back(a, tenant=1)
    again = pool.take(1, tenant=1)  # own dirty page: no zeroing needed
    assert _read(pool.pages[again[0]])[:1] == b"\xcd"
    other = pool.take(3, tenant=2)  # another tenant: zeroed first
    for pfn in other:
        assert _read(pool.pages[pfn]) == bytes(PAGE)
    assert pool.check() == [] and len(pool.pages) == 4
    pool.give_back(other + again, tenant=2)
    while pool.has_work():
        pool.maintain(1.0)
    assert not pool.dirty and len(pool.warm) == 2 and len(pool.pages) == 2  # trimmed to max
    assert pool.check() == []
    pool.close()


def test_pool_warm_min_refill(backend):
    pool = Pool(backend, budget_pages=8, warm_min=3, warm_max=5)
    while pool.has_work():
        pool.maintain(1.0)
    assert len(pool.warm) == 3 and pool.created == 3
    got = pool.take(5, tenant=1)
    assert len(got) == 5 and pool.created == 5
    pool.close()


def test_pool_check_finds_corruption(backend):
    pool = Pool(backend, budget_pages=4)
    got = pool.take(2, tenant=1)
    pool.warm.append(got[0])
    assert any("both" in x for x in pool.check())
    pool.warm.clear()
    del pool.owner[got[1]]
    assert any("leaked" in x for x in pool.check())
    pool.close()


# ---- arbiter -----------------------------------------------------------------------
def test_arbiter_integrity_and_detection(backend):
    cfg = Config(budget=16 * PAGE)
    pool = Pool(backend, 16)
    arb = Arbiter(cfg, pool, 16 * PAGE)
    a, b = socket.socketpair()
    t = arb.open_session(a, 123, 0, 0, None)
    ident = b"id-1"
    out = arb.handle(ident, p.Register(id=1, token=t.token, name="x"))
    assert isinstance(out.reply, p.Registered)
    g = arb.handle(ident, p.CreateGroup(id=2, token=t.token, n_regions=2, capacity=4 * PAGE)).reply
    out = arb.handle(ident, p.Grant(id=3, token=t.token, group=g.group, units=[0, 3]))
    assert isinstance(out.reply, p.Granted) and len(out.pfns_to_send) == 4
    assert arb.check_integrity() == []
    # corrupt: the same pfn in two slots
    grp = t.groups[g.group]
    grp.units[3][0] = grp.units[0][0]
    problems = arb.check_integrity()
    assert any("two slots" in x for x in problems)
    a.close()
    b.close()
