"""The fleet's router-protocol figures from its replicas' reports (no processes): what a
server's ``/v1/stats`` may say is checked like any input, and the per-model meanings."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from kvpool.fleet.endpoints_file import dns_name, entries, render
from kvpool.fleet.router_protocol import FleetProtocol, MemberKV, member_kv

STATS = {"kv_blocks": {"used": 3, "total": 40, "block_size": 16}}


def test_a_static_servers_stats_hold_all_of_its_blocks() -> None:
    assert member_kv(STATS) == MemberKV(used=3, held=40, grantable=0, block_size=16)


def test_an_elastic_servers_room_is_read() -> None:
    body = {**STATS, "kv_room": {"held": 10, "grantable": 20, "asleep": False,
                                 "kvpool:pool_free_bytes": 4096.0,
                                 "kvpool:granted_bytes": 2048.0}}
    kv = member_kv(body)
    assert (kv.held, kv.grantable, kv.pool_free, kv.granted) == (10, 20, 4096, 2048)
    assert kv.usage == 0.1


@pytest.mark.parametrize("bad", [
    None, [], "x", {}, {"kv_blocks": []},
    {"kv_blocks": {"used": -1, "total": 4, "block_size": 16}},
    {"kv_blocks": {"used": 1, "total": math.nan, "block_size": 16}},
    {"kv_blocks": {"used": True, "total": 4, "block_size": 16}},
    {"kv_blocks": {"used": 1, "total": 1 << 60, "block_size": 16}},
    {**STATS, "kv_room": {"held": "many", "grantable": 1}},
    {**STATS, "kv_room": {"held": 1, "grantable": 1, "asleep": "yes"}},
    {**STATS, "kv_room": {"held": 1, "grantable": 1.5}},
    {**STATS, "kv_room": []},
])
def test_a_bad_stats_body_is_one_value_error(bad) -> None:
    with pytest.raises(ValueError):
        member_kv(bad)


def member(state: str, kv: MemberKV | None, inflight: int = 0) -> SimpleNamespace:
    return SimpleNamespace(state=state, kv=kv, inflight=inflight)


def collect(members, waiting: int = 0) -> dict[str, dict[tuple, float]]:
    q = SimpleNamespace(members=members, waiting=waiting)
    out: dict[str, dict[tuple, float]] = {}
    for fam in FleetProtocol({"m": q}).collect():
        out[fam.name] = {tuple(sorted(s.labels.items())): s.value for s in fam.samples}
    return out


def only(fams: dict, name: str) -> float:
    (v,) = fams[name].values()
    return v


def test_the_fleets_use_is_its_least_used_awake_replica() -> None:
    busy = MemberKV(used=9, held=10, grantable=0, block_size=16, pool_free=100, granted=7)
    calm = MemberKV(used=1, held=10, grantable=10, block_size=16, pool_free=100, granted=5)
    gone = MemberKV(used=0, held=50, grantable=0, block_size=16, granted=99)
    f = collect([member("awake", busy, 3), member("awake", calm, 1),
                 member("failed", gone)], waiting=2)
    assert only(f, "vllm:kv_cache_usage_perc") == 0.05
    assert only(f, "vllm:num_requests_running") == 4
    assert only(f, "vllm:num_requests_waiting") == 2
    assert only(f, "kvpool:granted_bytes") == 12  # a failed replica's last words not counted
    assert only(f, "kvpool:asleep") == 0
    ((labels, v),) = f["vllm:cache_config_info"].items()
    assert v == 1 and dict(labels)["num_gpu_blocks"] == "30"  # 10 + 10 held, 10 grantable once


def test_a_model_with_no_awake_replica_says_asleep_and_zero_use() -> None:
    kv = MemberKV(used=0, held=0, grantable=8, block_size=16, asleep=True)
    f = collect([member("asleep", kv), member("stopped", None)])
    assert only(f, "kvpool:asleep") == 1
    assert only(f, "vllm:kv_cache_usage_perc") == 0
    f = collect([member("stopped", None)])
    assert only(f, "kvpool:asleep") == 0
    for fam in f.values():
        assert all(math.isfinite(v) and v >= 0 for v in fam.values())


def test_endpoint_names_are_dns_labels_and_the_text_is_yaml() -> None:
    import yaml

    assert dns_name("My Fleet/Qwen_2.5") == "my-fleet-qwen-2-5"
    es = entries("f", "ns", "10.0.0.1", 80, {"a.b": "awake", "a_b": "asleep",
                                            'q"x\ny': "stopped"})
    assert [e["name"] for e in es] == ["f-a-b", "f-a-b-2", "f-q-x-y"]
    doc = yaml.safe_load(render(es, "a header\nof two lines"))
    assert [e["labels"]["model"] for e in doc["endpoints"]] == ["a.b", "a_b", 'q"x\ny']
    assert doc["endpoints"][0]["port"] == 80
    assert yaml.safe_load(render([]))["endpoints"] == []
