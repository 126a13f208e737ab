"""What a tenant's allocation unit is, as the daemon shows it (issue 36 item 5): a group's
``chunk_units`` (CreateGroup: the units its allocator grants and releases together) is
``ps``'s ``chunk`` (bytes: units x regions x page size, the tenant's largest group) and
``map``'s per group, refused when larger than the group, kept across a daemon restart
(the tenant's Adopt carries it)."""

from __future__ import annotations

import json

from kvpool import protocol as p

from .helpers import PAGE, respawn, stop_daemon, wait_for


def tenant_row(d, name: str) -> dict:
    (row,) = [t for t in d.cli_json("ps")["tenants"] if t["name"] == name]
    return row


def test_ps_and_map_show_each_tenants_chunk(daemon):
    with daemon.connect("kv") as kv, daemon.connect("lease", kind="lease") as lease:
        small = kv.region_group(1, 4 * PAGE)  # a unit at a time: one page
        big = kv.region_group(2, 8 * PAGE, chunk_units=3)
        big.grant([0, 1, 2])
        small.grant([0])
        lease.lease(PAGE)
        assert tenant_row(daemon, "kv")["chunk"] == 3 * 2 * PAGE  # the larger group's
        assert tenant_row(daemon, "lease")["chunk"] == 0  # no group
        text = daemon.cli("ps").stdout
        assert "CHUNK" in text
        (kv_line,) = [ln for ln in text.splitlines() if " kv " in ln]
        assert "384 KiB" in kv_line  # 3 units of 2 x 64 KiB
        groups = {g["id"]: g for g in json.loads(daemon.cli("map", "--json").stdout)["groups"]}
        assert groups[big.id]["chunk_units"] == 3 and groups[small.id]["chunk_units"] == 1
        assert "granted 3 unit(s) (384 KiB) at a time" in daemon.cli("map").stdout
    assert daemon.check() == []


def test_a_chunk_larger_than_the_group_is_refused(daemon):
    with daemon.connect("kv") as kv:
        for chunk in (5, 0):  # more units than the group's 4 pages; none
            try:
                kv.call(p.CreateGroup(n_regions=1, capacity=4 * PAGE, chunk_units=chunk),
                        p.GroupCreated)
            except Exception as e:  # noqa: BLE001 - the client's typed refusal
                assert getattr(e, "code", None) == p.BAD_REQUEST, e
            else:
                raise AssertionError(f"a chunk of {chunk} units was accepted")
        assert tenant_row(daemon, "kv")["groups"] == 0


def test_the_chunk_survives_a_daemon_restart(daemon):
    with daemon.connect("kv", timeout_s=30) as kv:
        g = kv.region_group(2, 8 * PAGE, chunk_units=4)
        g.grant([0, 1, 2, 3])
        stop_daemon(daemon)
        respawn(daemon)
        wait_for(lambda: kv.reconnects == 1, what="the tenant's reconnect")
        row = wait_for(lambda: (r := tenant_row(daemon, "kv"))["mapped"] and r,
                       what="the adopted group")
        assert (row["chunk"], row["mapped"]) == (4 * 2 * PAGE, 4 * 2 * PAGE), row
    assert daemon.check() == []
