"""Ten thousand hostile control messages over all 32 request types (gang creation among them) (weight sets and sleep/wake among them) (forged and foreign
handoff tickets, hostile endpoints and locates among them), while two hostile
fd-channel peers misbehave (one never reads its descriptors, one announces Adopt
descriptors it never sends): each message gets an error reply, a live tenant keeps being
served, and afterwards the daemon is alive, no page has leaked, its invariants hold, and
its descriptor count and memory are back near where they started."""

from __future__ import annotations

import os
import time

import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.client_lib import handoff

from .helpers import PAGE, read_event
from .rawpeer import RawPeer, daemon_usage

N_MESSAGES = 10_000
REPLY_DEADLINE_MS = 120_000  # generous: whether the daemon answers, not how fast
BUDGET_PAGES = 1024
SINK_PAGES = 400  # more fd messages than a socket buffer holds
TENANT_OPS = ["grant", "release", "report", "create_group", "destroy_group", "bye",
              "lease", "reclaimed", "adopt", "offer", "claim", "cancel", "locate",
              "weight_create", "weight_seal", "weight_attach", "weight_detach",
              "weight_write", "weight_publish", "weight_use", "tenant_state", "create_gang", "room"]
ALL_OPS = ["register", *TENANT_OPS, "ping", "ps", "stats", "map", "set_limit", "check", "events",
           "shutdown", "sleep_tenant"]
assert sorted(ALL_OPS) == sorted(t.__struct_config__.tag for t in p.REQUESTS)  # all covered

# A field spec per op: name -> kind ("int", "list", "str", "bool", "oint", "olist", "ostr")
FIELDS = {
    "register": {"name": "str", "kind": "str", "device": "int", "version": "int",
                 "endpoint": "ostr", "gang": "gtoken", "rank": "oint", "layout": "layout"},
    "create_gang": {"devices": "devices", "layout": "layout"},
    "create_group": {"n_regions": "int", "capacity": "int", "bases": "list", "label": "str",
                     "chunk_units": "int"},
    "destroy_group": {"group": "int"},
    "grant": {"group": "int", "units": "list", "in_use": "oint", "reserve": "olist"},
    "release": {"group": "int", "units": "list", "in_use": "oint", "reserve": "olist"},
    "report": {"group": "int", "in_use": "oint", "reserve": "olist"},
    "map": {"tenant": "ostr", "pfns": "bool"},
    "events": {"since": "int", "follow": "bool", "tenant": "ostr"},
    "set_limit": {"tenant": "str", "max": "int"},
    "lease": {"bytes": "huge"},
    "reclaimed": {"seq": "int", "freed": "oint"},
    "adopt": {"groups": "groups", "lease": "huge", "nfds": "zero"},
    "offer": {"group": "int", "units": "list", "to": "str", "ttl_ms": "ttl"},
    "claim": {"ticket": "ticket", "group": "int", "units": "list", "giver": "oint"},
    "cancel": {"ticket": "ticket"},
    "locate": {"name": "str", "as_giver": "bool"},
    "weight_create": {"key": "wkey", "nbytes": "huge", "mutable": "bool"},
    "weight_seal": {"key": "wkey"},
    "weight_attach": {"key": "wkey", "write": "bool"},
    "weight_detach": {"key": "wkey"},
    "weight_write": {"key": "wkey"},
    "weight_publish": {"key": "wkey"},
    "weight_use": {"key": "wkey", "version": "int"},
    "sleep_tenant": {"name": "str", "wake": "bool"},
    "tenant_state": {"state": "state"},
}
for op in ALL_OPS:
    FIELDS.setdefault(op, {})

ints = st.integers(-(2**63), 2**64 - 1)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=20), st.binary(max_size=20))
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=4) |
                        st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=8)
WRONG = {
    "int": st.one_of(st.text(max_size=8), st.floats(), st.booleans(), st.lists(ints, max_size=3),
                     st.integers(-(2**63), -1), st.integers(min_value=2**63, max_value=2**64 - 1),
                     st.binary(max_size=4)),
    "oint": st.one_of(st.text(max_size=8), st.floats(), st.booleans(), st.integers(-(2**63), -1)),
    "list": st.one_of(ints, st.text(max_size=8), st.dictionaries(st.text(max_size=4), ints, max_size=2),
                      st.lists(st.one_of(st.text(max_size=3), st.floats(), st.integers(-(2**63), -1)), min_size=1, max_size=4)),
    "olist": st.one_of(ints, st.text(max_size=8), st.lists(st.integers(-(2**63), -1), min_size=1, max_size=3)),
    "str": st.one_of(ints, st.lists(st.text(max_size=3), max_size=2), st.binary(max_size=4), st.none(),
                     st.text(min_size=p.MAX_NAME + 1, max_size=p.MAX_NAME + 10)),
    "ostr": st.one_of(ints, st.lists(st.text(max_size=3), max_size=2), st.binary(max_size=4),
                      st.text(min_size=p.MAX_NAME + 1, max_size=p.MAX_NAME + 10)),
    "bool": st.one_of(ints, st.text(max_size=3), st.none()),
    "huge": st.one_of(st.text(max_size=8), st.floats(), st.integers(-(2**63), -1),
                      st.integers(p.MAX_BYTES + 1, 2**64 - 1)),
    "zero": st.one_of(st.text(max_size=8), st.integers(-(2**63), -1),
                      st.integers((1 << 20) + 1, 2**64 - 1)),
    "ticket": st.one_of(ints, st.none(), st.binary(max_size=16),  # malformed or oversized
                        st.text(alphabet="0123456789abcdef", max_size=31),
                        st.text(alphabet="0123456789abcdef", min_size=33, max_size=200),
                        st.text(alphabet="0123456789ABCDEFG-", min_size=32, max_size=32)),
    "wkey": st.one_of(ints, st.none(), st.binary(max_size=16),  # malformed content keys
                      st.text(alphabet="0123456789abcdef", max_size=63),
                      st.text(alphabet="0123456789abcdef", min_size=65, max_size=200),
                      st.text(alphabet="0123456789ABCDEFG-", min_size=64, max_size=64)),
    "state": st.one_of(ints, st.none(), st.booleans(), st.binary(max_size=8),  # bad states
                       st.text(max_size=12).filter(lambda s: s not in p.SLEEP_STATES),
                       st.sampled_from(["awake", "ASLEEP", "idle ", "sleeping", ""])),
    "gtoken": st.one_of(ints, st.binary(max_size=16),  # malformed gang tokens
                        st.text(alphabet="0123456789abcdef", max_size=31),
                        st.text(alphabet="0123456789abcdef", min_size=33, max_size=200),
                        st.text(alphabet="0123456789ABCDEFG-", min_size=32, max_size=32)),
    "devices": st.one_of(ints, st.none(), st.text(max_size=4), st.lists(ints, max_size=1),
                         st.lists(st.integers(-(2**63), -1), min_size=2, max_size=3),
                         st.lists(st.integers(p.MAX_DEVICE + 1, 2**40), min_size=2, max_size=3),
                         st.lists(st.integers(0, 3), min_size=p.MAX_RANKS + 1,
                                  max_size=p.MAX_RANKS + 3)),
    "layout": st.one_of(ints, st.text(max_size=4), st.just([]), st.lists(ints, min_size=1, max_size=2),
                        st.lists(st.fixed_dictionaries({"n_regions": st.integers(-3, 0),
                                                        "capacity": st.just(PAGE)}),
                                 min_size=1, max_size=2),
                        st.lists(st.fixed_dictionaries({"n_regions": st.just(1),
                                                        "capacity": st.integers(-3, 0)}),
                                 min_size=1, max_size=2)),
    "ttl": st.one_of(st.integers(-(2**63), 0), st.integers(p.MAX_TTL_MS + 1, 2**64 - 1),
                     st.floats(), st.text(max_size=4)),
    "groups": st.one_of(ints, st.text(max_size=8), st.lists(ints, min_size=1, max_size=3),
                        st.lists(st.fixed_dictionaries({"id": st.integers(-5, 0),
                                                        "n_regions": st.integers(1, 2),
                                                        "capacity": st.just(PAGE)}),
                                 min_size=1, max_size=2)),
}
GOOD = {
    "int": st.integers(0, 100), "oint": st.integers(0, 100), "list": st.lists(st.integers(0, 7), max_size=3),
    "olist": st.lists(st.integers(0, 7), max_size=3), "str": st.just("x"), "ostr": st.just("x"),
    "bool": st.booleans(), "huge": st.integers(2**40, p.MAX_BYTES),  # (past the budget)
    "zero": st.just(0), "groups": st.just([]),
    "ticket": st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),  # forged
    "ttl": st.integers(1, 100),
    "wkey": st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),  # forged
    "state": st.sampled_from(p.SLEEP_STATES),
    "gtoken": st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),  # forged
    # a device this (one-device) daemon does not serve, or one named twice
    "devices": st.sampled_from([[0, 1], [0, 0], [1, 0], [0, 1, 2]]),
    "layout": st.lists(st.fixed_dictionaries({"n_regions": st.integers(1, 4),
                                              "capacity": st.integers(1, 8).map(lambda n: n * PAGE)}),
                       min_size=1, max_size=3),
}


class Env:
    """The test's view: an anonymous socket, the attacker's socket and token, ids."""

    anon: zmq.Socket
    attacker_sock: zmq.Socket
    attacker_token: str
    attacker_group: int
    victim_groups: list[int]
    ticket: str  # a real, pending ticket for another tenant (not the attacker)
    sent = 0


def send(env: Env, frames: list[bytes], attacker: bool) -> p.Reply:
    sock = env.attacker_sock if attacker else env.anon
    sock.send_multipart(frames)
    env.sent += 1
    # an outcome, not a latency: a refusal may wait behind a 100,000-frame message and
    # a busy machine (load 5-10) stretches that many times over an idle core's
    assert sock.poll(REPLY_DEADLINE_MS), "the daemon stopped answering"
    return p.decode_reply(sock.recv_multipart()[-1])  # (a REQ-style envelope is echoed)


def with_header(d: dict, rid: int, token: str = "") -> dict:
    return {"id": rid, "token": token, **d}


def hostile(env: Env):
    ids = st.integers(1, 2**40)
    ops = st.sampled_from(ALL_OPS)

    @st.composite
    def wrong_type(draw):
        op = draw(st.sampled_from([o for o in ALL_OPS if FIELDS[o]]))
        fields = {k: draw(GOOD[kind]) for k, kind in FIELDS[op].items()}
        bad = draw(st.sampled_from(sorted(FIELDS[op])))
        fields[bad] = draw(WRONG[FIELDS[op][bad]])
        rid = draw(ids)
        return ("attacker", [p.encode({"op": op, **with_header(fields, rid, env.attacker_token)})], rid)

    @st.composite
    def unknown_op(draw):
        op = draw(st.one_of(st.text(max_size=12).filter(lambda s: s not in ALL_OPS), ints,
                            st.none(), st.lists(ints, max_size=2)))
        rid = draw(ids)
        return ("anon", [p.encode({"op": op, "id": rid})], rid)

    @st.composite
    def unknown_field(draw):
        op = draw(ops)
        name = draw(st.text(min_size=1, max_size=10).filter(
            lambda s: s not in {"op", "id", "token", *FIELDS[op]}))
        rid = draw(ids)
        return ("anon", [p.encode({"op": op, "id": rid, name: draw(anything)})], rid)

    @st.composite
    def garbage(draw):
        data = draw(st.binary(max_size=64))
        try:
            p.decode_request(data)
        except p.DecodeError:
            return ("anon", [data], None)
        return ("anon", [b"\xc1"], None)  # (a valid request by chance: use an invalid byte)

    @st.composite
    def truncated(draw):
        op = draw(st.sampled_from(["grant", "release", "ps", "map", "register"]))
        fields = {k: draw(GOOD[kind]) for k, kind in FIELDS[op].items()}
        frame = p.encode({"op": op, **with_header(fields, draw(ids), env.attacker_token)})
        return ("attacker", [frame[: draw(st.integers(0, len(frame) - 1))]], None)

    @st.composite
    def bad_token(draw):
        op = draw(st.sampled_from(TENANT_OPS))
        token = draw(st.one_of(st.text(alphabet="0123456789abcdef", min_size=1, max_size=32),
                               st.just(env.attacker_token)))  # a stolen token, wrong socket
        rid = draw(ids)
        fields = {"grant": {"group": env.attacker_group, "units": [1]},
                  "release": {"group": env.attacker_group, "units": [0]},
                  "report": {"group": env.attacker_group},
                  "create_group": {"n_regions": 1, "capacity": PAGE},
                  "destroy_group": {"group": env.attacker_group}, "bye": {},
                  "lease": {"bytes": PAGE}, "reclaimed": {"seq": 1}, "adopt": {},
                  "offer": {"group": env.attacker_group, "units": [0], "to": "victim"},
                  "claim": {"ticket": env.ticket, "group": env.attacker_group, "units": [3]},
                  "cancel": {"ticket": env.ticket}, "locate": {"name": "victim"},
                  "weight_create": {"key": "ab" * 32, "nbytes": PAGE},
                  "weight_seal": {"key": "ab" * 32}, "weight_attach": {"key": "ab" * 32},
                  "weight_detach": {"key": "ab" * 32},
                  "weight_write": {"key": "ab" * 32}, "weight_publish": {"key": "ab" * 32},
                  "weight_use": {"key": "ab" * 32, "version": 1},
                  "tenant_state": {"state": "idle"}, "room": {},
                  "create_gang": {"devices": [0, 1], "layout": [{"n_regions": 1,
                                                                 "capacity": PAGE}]}}[op]
        return ("anon", [p.encode({"op": op, **with_header(fields, rid, token)})], rid)

    @st.composite
    def foreign_group(draw):
        op = draw(st.sampled_from(["grant", "release", "report", "destroy_group"]))
        group = draw(st.one_of(st.sampled_from(env.victim_groups),
                               st.integers(0, 2**40).filter(lambda g: g != env.attacker_group)))
        rid = draw(ids)
        fields = {"group": group}
        if op in ("grant", "release"):
            fields["units"] = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True))
        return ("attacker", [p.encode({"op": op, **with_header(fields, rid, env.attacker_token)})], rid)

    @st.composite
    def bad_units(draw):
        rid = draw(ids)
        g = env.attacker_group
        case = draw(st.sampled_from(["release_unheld", "grant_held", "out_of_range", "duplicate"]))
        if case == "release_unheld":
            req = {"op": "release", "units": draw(st.lists(st.integers(1, 7), min_size=1, max_size=4))}
        elif case == "grant_held":
            req = {"op": "grant", "units": [0, *draw(st.lists(st.integers(1, 7), max_size=2, unique=True))]}
        elif case == "out_of_range":
            req = {"op": draw(st.sampled_from(["grant", "release"])),
                   "units": [draw(st.integers(8, p.MAX_PAGES_PER_REGION - 1))]}
        else:
            u = draw(st.integers(1, 7))
            req = {"op": draw(st.sampled_from(["grant", "release"])), "units": [u, u]}
        return ("attacker", [p.encode({**req, **with_header({"group": g}, rid, env.attacker_token)})], rid)

    @st.composite
    def bad_values(draw):
        rid = draw(ids)
        case = draw(st.sampled_from(["capacity", "regions", "limit", "map", "register", "huge_bases",
                                     "locate", "endpoint", "sleep", "gang"]))
        tok = env.attacker_token
        if case == "capacity":
            cap = draw(st.integers(0, 64)) * PAGE + draw(st.integers(1, PAGE - 1))
            req = {"op": "create_group", "n_regions": 1, "capacity": cap}
        elif case == "regions":
            req = {"op": "create_group", "capacity": PAGE,
                   "n_regions": draw(st.one_of(st.just(0), st.integers(p.MAX_REGIONS + 1, 2**40)))}
        elif case == "limit":
            req = {"op": "set_limit", "tenant": draw(st.sampled_from(["", "bad name", "a/b"])),
                   "max": draw(st.integers(0, 10))}
        elif case == "map":
            req = {"op": "map", "tenant": draw(st.sampled_from(["nobody", "999999", "ghost"]))}
        elif case == "register":
            req = {"op": "register", "name": "again", "version": draw(st.integers(0, 10))}
        elif case == "locate":  # names nobody it may receive from holds (or its own)
            req = {"op": "locate", "name": draw(st.sampled_from(["nobody", "ghost", "attacker"]))}
        elif case == "sleep":  # malformed names (a well-formed one is answered: no error)
            req = {"op": "sleep_tenant", "name": draw(st.sampled_from(
                ["", "bad name", "a/b", "x" * (p.MAX_NAME + 1), "\x00"])),
                   "wake": draw(st.booleans())}
        elif case == "gang":  # a forged gang join, or a gang no device here can hold
            req = draw(st.sampled_from([
                {"op": "register", "name": "attacker", "gang": "ab" * 16, "rank": 1,
                 "layout": [{"n_regions": 1, "capacity": PAGE}]},
                {"op": "register", "name": "again", "gang": "ab" * 16},
                {"op": "create_gang", "devices": [0, 7],
                 "layout": [{"n_regions": 1, "capacity": PAGE}]},
                {"op": "create_gang", "devices": [0, 0],
                 "layout": [{"n_regions": 1, "capacity": PAGE}]}]))
        elif case == "endpoint":  # hostile endpoints (and a second register)
            req = {"op": "register", "name": "again", "endpoint": draw(st.sampled_from(
                ["http://10.0.0.1:80", "http://127.0.0.1:0", "file:///x", "http://127.0.0.1:80"]))}
        else:
            req = {"op": "create_group", "n_regions": 2, "capacity": PAGE,
                   "bases": draw(st.lists(st.integers(0, 2**40), min_size=3, max_size=5))}
        return ("attacker", [p.encode({**req, **with_header({}, rid, tok)})], rid)

    @st.composite
    def multi_frame(draw):
        frames = draw(st.lists(st.binary(max_size=16), min_size=2, max_size=4))
        if len(frames) == 2 and frames[0] == b"":
            frames[1] = b"\xc1"  # keep the REQ-style envelope invalid too
        return ("anon", frames, None)

    @st.composite
    def forged_ticket(draw):
        """Tickets the attacker may not use: forged ids, a real ticket meant for the
        victim (claimed into the attacker's group, or cancelled: not its offer), offers of
        units it does not hold or of another tenant's group."""
        rid = draw(ids)
        g = env.attacker_group
        case = draw(st.sampled_from(["forged", "foreign", "cancel", "offer_unheld",
                                     "offer_foreign"]))
        forged = draw(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32))
        if case == "forged":
            req = {"op": draw(st.sampled_from(["claim", "cancel"])), "ticket": forged}
            if req["op"] == "claim":
                req.update(group=g, units=[draw(st.integers(1, 7))])
        elif case == "foreign":
            req = {"op": "claim", "ticket": env.ticket, "group": g, "units": [3]}
        elif case == "cancel":
            req = {"op": "cancel", "ticket": env.ticket}
        elif case == "offer_unheld":
            req = {"op": "offer", "group": g, "to": "victim",
                   "units": draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))}
        else:
            req = {"op": "offer", "group": draw(st.sampled_from(env.victim_groups)),
                   "units": [0], "to": "attacker"}
        return ("attacker", [p.encode({**req, **with_header({}, rid, env.attacker_token)})], rid)

    return st.one_of(wrong_type(), unknown_op(), unknown_field(), garbage(), truncated(),
                     bad_token(), foreign_group(), bad_units(), bad_values(), multi_frame(),
                     forged_ticket())


def test_ten_thousand_hostile_messages(start_daemon, tmp_path):
    d = start_daemon(budget=str(BUDGET_PAGES * PAGE), extra=("--warm-max", "0"))  # (fds: pages)
    stop = tmp_path / "stop"
    victim = d.worker("churn", "--name", "victim", "--seconds", "600", "--until-file", str(stop),
                      "--max-blocks", "48", "--low", "0", "--high", "1", "--pace-ms", "0.5")
    read_event(victim, "ready")
    fds0, rss0 = daemon_usage(d.pid)
    sink, adopter = fd_channel_attackers(d)
    ctx = zmq.Context.instance()
    env = Env()
    with d.connect("attacker") as attacker, d.connect("giver") as giver:
        gg = giver.region_group(1, 8 * PAGE)  # a real ticket, for someone else
        gg.grant([0])
        ticket = handoff.offer(gg, [0], to="victim", ttl_s=p.MAX_TTL_MS / 1000)
        env.ticket = ticket.id
        ag = attacker.region_group(1, 8 * PAGE)
        ag.grant([0])
        env.attacker_group = ag.id
        env.attacker_token = attacker.conn.token
        env.attacker_sock = attacker.conn.sock
        with d.monitor() as m:
            env.victim_groups = [g.id for g in m.map("victim").groups]
        assert env.victim_groups
        env.anon = ctx.socket(zmq.DEALER)
        env.anon.setsockopt(zmq.LINGER, 0)
        env.anon.connect(paths.control_endpoint(d.run_dir))
        started = time.monotonic()

        @settings(max_examples=N_MESSAGES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(msg=hostile(env))
        def one(msg):
            channel, frames, rid = msg
            with attacker.conn._lock:  # the attacker's own socket, raw
                reply = send(env, frames, channel == "attacker")
            assert isinstance(reply, p.Error), (msg, reply)
            assert reply.code in p.CODES
            if rid is not None:
                assert reply.id == rid, (msg, reply)

        one()
        # a few big ones hypothesis would not generate: huge counts and oversized frames
        for frames in (
            [p.encode({"op": "grant", "id": 1, "token": env.attacker_token, "group": ag.id,
                       "units": list(range(p.MAX_UNITS + 1))})],
            [p.encode({"op": "release", "id": 2, "token": env.attacker_token, "group": ag.id,
                       "units": list(range(2, 2 + p.MAX_UNITS))})],
            [b"\x81" + b"x" * (p.MAX_FRAME + 10)],
            [p.encode({"op": "ps", "id": 3, "token": "", "pad": "y" * (p.MAX_FRAME + 1)})],
            [p.encode({"op": "adopt", "id": 4, "token": env.attacker_token, "nfds": 3})],
            [p.encode({"op": "lease", "id": 5, "token": env.attacker_token, "bytes": p.MAX_BYTES})],
            [p.encode({"op": "shutdown", "id": 6, "token": ""})],  # no admin session
            [p.encode({"op": "ping", "id": 7})] * 100_000,  # refused unbuffered
        ):
            with attacker.conn._lock:
                reply = send(env, frames, True)
            assert isinstance(reply, p.Error), reply
        elapsed = time.monotonic() - started
        assert env.sent >= N_MESSAGES, env.sent

        # the attacker itself still works, and the victim is still being served
        ag.release([0])
        ag.grant([1, 2])
        assert victim.poll() is None, victim.stderr.read()
        with d.monitor() as m:
            (v,) = [t for t in m.ps().tenants if t.name == "victim"]
            assert v.registered
        assert not ticket.settled and gg.mapped == {0}  # no hostile message spoiled it
        assert handoff.cancel(giver, ticket) is True
        env.anon.close()
    check_fd_channel_attackers(d, sink, adopter)
    stop.touch()
    done = read_event(victim, "done")
    assert victim.wait(20) == 0
    assert done["ok"] > 100 and done["grants"] > 10, done  # served all along
    assert d.check() == []
    s = d.stats()
    assert s.pool.granted == 0 and not s.tenants, s
    assert s.errors >= N_MESSAGES
    deadline = time.monotonic() + 120  # (pages the sink never took are retained until
    while daemon_usage(d.pid)[0] > fds0 + 2 and time.monotonic() < deadline:  # its socket
        time.sleep(0.1)  # is gone, then freed on the daemon's liveness timer)
    fds, rss = daemon_usage(d.pid)
    assert fds <= fds0 + 2, (fds0, fds)  # every session's and page's descriptor closed
    assert rss < rss0 + (48 << 20), (rss0, rss)
    print(f"{env.sent} hostile messages in {elapsed:.1f} s; victim: {done}")


def fd_channel_attackers(d) -> tuple[RawPeer, RawPeer]:
    """A peer pipelining 400 one-page grants and never reading a descriptor (its socket
    fills after a few hundred), and one whose Adopt announces 4 descriptors and sends 1."""
    sink = RawPeer(d.run_dir)
    sink.register("sink")
    gid = sink.group(SINK_PAGES, PAGE)
    for u in range(SINK_PAGES):
        sink.send(p.Grant(group=gid, units=[u]))
    adopter = RawPeer(d.run_dir)
    adopter.register("adopter")
    rid = adopter.adopt_id = adopter.send(p.Adopt(nfds=4))
    fd = os.memfd_create("not-a-page")
    try:
        fdchannel.send_fds(adopter.fd, p.encode(p.FdHeader(rid, 4, 0)), [fd])
    finally:
        os.close(fd)
    return sink, adopter


def check_fd_channel_attackers(d, sink: RawPeer, adopter: RawPeer) -> None:
    """The Adopt was refused; the sink was dropped (its socket stayed full)."""
    while True:
        reply = adopter.recv(30)
        if reply.id == adopter.adopt_id:
            assert isinstance(reply, p.Error), reply
            assert reply.code in (p.BAD_REQUEST, p.UNAUTHORIZED), reply
            break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with d.monitor() as m:
            if not [t for t in m.ps().tenants if t.name == "sink"]:
                break
        time.sleep(0.1)
    else:
        raise AssertionError("the peer that never reads its fd channel was not dropped")
    sink.close()
    adopter.close()
