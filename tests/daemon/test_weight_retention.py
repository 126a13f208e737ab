"""Who pays for a weight set's pages that someone keeps after the set is gone (issue 33,
item 1; docs/THREAT-MODEL.md, "Weight sets"), against a real daemon and real processes.

A dropped set (a loading set detached, its creator dead, a cached set evicted) returns
its pages; whoever kept its descriptors or mappings keeps that memory alive. Those pages
are charged to the set's creator's uid (and configured name) like the retained pages of
an ended session: they count against that uid's ``max``, show in ``ps``'s retained by
uid, and ``kvpool check`` finds no retained page charged to nobody. So a tenant that
creates, keeps and detaches set after set stops at its own max, and the rest of the
budget stays everyone else's."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kvpool import protocol as p
from kvpool.client_lib import NoMemory, OverLimit

from .helpers import PAGE, read_event, wait_for
from .test_attacks_round3 import NOBODY, group_daemon, needs_root, nobody_proc
from .test_weight_sets import KEY_A, loaded, spawn, weights_bytes

BUDGET = 64  # pages
UID = os.getuid()


def key(i: int) -> str:
    return f"{i:02x}" * 32


def retained_by_uid(d) -> dict[int, int]:
    with d.monitor() as m:
        return dict(m.ps().retained_by_uid)


def test_kept_descriptors_of_dropped_sets_count_against_the_creators_max(start_daemon):
    """The attack: max 8 pages, create a set, keep its descriptors, detach (the set is
    dropped), eight times. Only the first fits its max (the kept 8 pages are its uid's);
    an honest tenant gets the other 56 pages of the 64-page budget."""
    d = start_daemon(budget=str(BUDGET * PAGE))
    kept: list[int] = []
    refused: list[OverLimit] = []
    try:
        with d.connect("attacker", max=8 * PAGE) as a:
            for i in range(8):
                try:
                    _, fds = a.call(p.WeightCreate(key=key(i), nbytes=8 * PAGE),
                                    p.WeightGranted)
                except OverLimit as e:
                    refused.append(e)
                    continue
                kept.extend(fds)
                a.call(p.WeightDetach(key=key(i)), p.Done)  # loading: dropped
            assert len(kept) == 8 and len(refused) == 7, (len(kept), refused[:1])
            assert "kept" in str(refused[0]), refused[0]
            assert weights_bytes(d) == 0
            with d.connect("honest") as h:
                g = h.region_group(1, (BUDGET - 8) * PAGE)
                g.grant(list(range(BUDGET - 8)))  # the budget less the attacker's max
            assert retained_by_uid(d) == {UID: 8 * PAGE}
            table = d.cli("ps").stdout
            assert "retained by uid" in table and f"uid {UID}" in table, table
            assert d.check() == []
    finally:
        for fd in kept:
            os.close(fd)
    wait_for(lambda: d.stats().pool.retained == 0, what="the kept pages are gone")
    assert d.check() == []


def test_a_creator_that_forks_before_dying_leaves_its_uid_charged(start_daemon):
    """The creator forks (the child keeps the descriptors and the mapping) and is
    killed mid-load: the set is dropped, and its 8 pages, kept by the child, are charged
    to the creator's uid until the child lets go."""
    d = start_daemon(budget=str(BUDGET * PAGE))
    w = spawn(d, "create", KEY_A, str(8 * PAGE), "--fork", "--name", "forker")
    try:
        ready = read_event(w, "ready")
        assert ready["state"] == "loading" and ready["child"] > 0
        w.send_signal(signal.SIGKILL)
        w.wait(timeout=30)
        wait_for(lambda: weights_bytes(d) == 0, what="the half-loaded set dropped")
        with d.connect("again", max=8 * PAGE) as t:
            with pytest.raises(OverLimit, match="kept"):  # its uid keeps 8 pages
                loaded(t, KEY_A, bytes(8 * PAGE))
            assert retained_by_uid(d) == {UID: 8 * PAGE}
            assert d.check() == []
    finally:
        assert w.stdin is not None
        w.stdin.close()  # the child's stdin too: it exits
    wait_for(lambda: d.stats().pool.retained == 0, what="the child's pages are gone")
    with d.connect("later", max=8 * PAGE) as t:
        loaded(t, KEY_A, bytes(8 * PAGE))
    assert d.check() == []


def test_an_evicted_cached_set_kept_by_a_former_holder_is_its_creators_uids(start_daemon):
    """A holder keeps the descriptors of a sealed set and detaches; nobody holds the set,
    so it is cached, then evicted for a grant: the kept pages are charged to the creator's
    uid (not to the set, which no longer exists)."""
    d = start_daemon(budget=str(BUDGET * PAGE))
    kept: list[int] = []
    try:
        with d.connect("creator") as c, d.connect("keeper") as k, d.connect("kv") as kv:
            loaded(c, KEY_A, bytes(32 * PAGE)).detach()
            _, fds = k.call(p.WeightAttach(key=KEY_A), p.WeightGranted)
            kept.extend(fds)
            k.call(p.WeightDetach(key=KEY_A), p.Done)
            assert weights_bytes(d) == 32 * PAGE  # cached
            g = kv.region_group(1, BUDGET * PAGE)
            with pytest.raises(NoMemory):  # the set is evicted for it, but its pages stay
                g.grant(list(range(BUDGET - 32 + 1)))
            assert weights_bytes(d) == 0
            wait_for(lambda: retained_by_uid(d) == {UID: 32 * PAGE},
                     what="the kept pages charged to the creator's uid")
            assert d.check() == []
    finally:
        for fd in kept:
            os.close(fd)
    wait_for(lambda: d.stats().pool.retained == 0, what="the kept pages are gone")
    assert d.check() == []


KEEPER = """
    from kvpool.client_lib import connect, OverLimit
    t = connect(name="keeper", run_dir=run_dir, max=8 * 65536)
    kept, refused = [], None
    for i in range(8):
        key = f"{i:02x}" * 32
        try:
            _, fds = t.call(p.WeightCreate(key=key, nbytes=8 * 65536), p.WeightGranted)
        except OverLimit as e:
            refused = [e.code, e.message]
            continue
        kept.extend(fds)
        t.call(p.WeightDetach(key=key), p.Done)
    print(json.dumps({"kept": len(kept), "refused": refused}), flush=True)
    sys.stdin.readline()
"""


@needs_root
def test_another_uids_kept_sets_leave_an_honest_uid_the_rest(start_daemon, tmp_path):
    """The attack across uids: uid 65534 (max 8 pages) creates, keeps and detaches sets;
    root's honest grant of the other 56 pages of the 64-page budget is served, and
    nothing of 65534's is charged to root."""
    d = group_daemon(start_daemon, tmp_path, extra=("--budget", str(BUDGET * PAGE)))
    attacker = nobody_proc(d, KEEPER)
    line = attacker.stdout.readline()
    assert line, attacker.stderr.read()
    got = json.loads(line)
    assert got["kept"] == 8 and got["refused"][0] == p.OVER_LIMIT, got
    with d.connect("honest") as h:
        g = h.region_group(1, (BUDGET - 8) * PAGE)
        g.grant(list(range(BUDGET - 8)))
        assert retained_by_uid(d) == {NOBODY: 8 * PAGE}
        assert d.check() == []
    attacker.stdin.write("\n")
    attacker.stdin.flush()
    assert attacker.wait(30) == 0
    wait_for(lambda: d.stats().pool.retained == 0, what="the kept pages are gone")
    assert d.check() == []
