"""Replica pickers (kvpool.fleet.balance): prefix affinity (longest match, saturation,
bounded memory, ready-only), the reason seam, and the routing key of hostile bodies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.fleet import balance, prompt
from kvpool.fleet.balance import (LeastLoaded, Pick, PrefixAffinity, ReplicaLoad, RoundRobin,
                                  choose, make_picker, prompt_of)
from kvpool.fleet.prefix_key import prefix_chain

B = 16  # tokens per block (the engines' block size)


def idle(n: int, capacity: int = 8) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, 0, capacity, True) for i in range(n)]


def loads(*inflight: int, capacity: int = 8, ready: tuple[bool, ...] = ()) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, n, capacity, ready[i] if ready else True)
            for i, n in enumerate(inflight)]


def ids(blocks: int, group: int, tail: int = 0) -> tuple[int, ...]:
    """``blocks`` full blocks of group ``group``'s prefix, then ``tail`` ids unique to it."""
    return tuple(group * 1000 + i for i in range(blocks * B)) + tuple(
        range(10**6 + tail * 100, 10**6 + tail * 100 + B))


def test_the_registry_has_prefix_and_refuses_unknown_names() -> None:
    assert isinstance(make_picker("prefix"), PrefixAffinity)
    assert sorted(balance.PICKERS) == ["least_loaded", "prefix", "round_robin"]
    with pytest.raises(ValueError, match="unknown routing 'nope'.*prefix"):
        make_picker("nope")


def test_a_group_follows_its_first_request() -> None:
    p = PrefixAffinity()
    first = p.choose(ids(4, group=1, tail=1), idle(3))
    assert first.reason == "load" and first.matched_blocks == 0
    again = p.choose(ids(4, group=1, tail=2), idle(3))
    assert again == Pick(first.index, "prefix", 4)


def test_the_longest_match_wins() -> None:
    p = PrefixAffinity()
    # replica 0 gets 2 blocks of group 1 (the least loaded), replica 1 gets 4 (0 is full)
    assert p.choose(ids(2, group=1, tail=1), loads(0, 3, 3)).index == 0
    assert p.choose(ids(4, group=1, tail=2), loads(8, 0, 3)) == Pick(1, "load", 0)
    assert p.choose(ids(4, group=1, tail=3), loads(0, 1, 0)) == Pick(1, "prefix", 4)
    # 2 blocks match on both: the lower load, then the lower index
    shared2 = ids(2, group=1, tail=4)
    assert p.choose(shared2, loads(1, 0, 0)) == Pick(1, "prefix", 2)
    assert p.choose(ids(2, group=1, tail=5), idle(3)) == Pick(0, "prefix", 2)


def test_a_saturated_holder_falls_back_to_the_least_loaded() -> None:
    p = PrefixAffinity(load_margin=0.25)  # capacity 8: up to 2 requests above the least
    home = p.choose(ids(3, group=7, tail=1), loads(0, 0)).index
    other = 1 - home

    def at(home_load: int, other_load: int) -> list[ReplicaLoad]:
        x = [0, 0]
        x[home], x[other] = home_load, other_load
        return loads(*x)

    assert p.choose(ids(3, group=7, tail=2), at(2, 0)) == Pick(home, "prefix", 3)
    assert p.choose(ids(3, group=7, tail=3), at(3, 0)) == Pick(other, "load", 0)
    # full (inflight >= capacity) is saturated whatever the others' load; all full: the
    # least loaded
    fresh = PrefixAffinity()
    home = fresh.choose(ids(3, group=8), loads(0, 0)).index
    full = [ReplicaLoad(home, 8, 8, True), ReplicaLoad(1 - home, 7, 8, True)]
    assert fresh.choose(ids(3, group=8, tail=5), full).index == 1 - home
    all_full = [ReplicaLoad(home, 9, 8, True), ReplicaLoad(1 - home, 8, 8, True)]
    assert fresh.choose(ids(3, group=8, tail=6), all_full).index == 1 - home


def test_only_ready_replicas_are_chosen() -> None:
    p = PrefixAffinity()
    home = p.choose(ids(2, group=3), idle(2)).index
    down = [ReplicaLoad(i, 0, 8, i != home) for i in range(2)]
    assert p.choose(ids(2, group=3, tail=1), down) == Pick(1 - home, "only", 0)
    three = [ReplicaLoad(0, 5, 8, False), ReplicaLoad(1, 6, 8, True), ReplicaLoad(2, 0, 8, False)]
    for picker in (PrefixAffinity(), LeastLoaded(), RoundRobin()):
        for _ in range(3):
            assert choose(picker, ids(1, group=4), three).index == 1
        with pytest.raises(ValueError, match="no ready replica"):
            choose(picker, ids(1, group=4), [ReplicaLoad(0, 0, 8, False)])


def test_an_empty_or_short_prompt_goes_by_load() -> None:
    p = PrefixAffinity()
    for short in ("", (), "x" * 63, tuple(range(B - 1))):
        assert prefix_chain(short) == []
        assert p.choose(short, loads(3, 1, 2)) == Pick(1, "load", 0)
        assert p.choose(short, loads(3, 1, 2)) == Pick(1, "load", 0)  # never "prefix"
    assert p.remembered() == 0


def test_text_is_keyed_by_character_chunks_and_ids_by_blocks() -> None:
    system = "You are a terse assistant. " * 10  # 270 characters: 4 chunks of 64
    assert len(prefix_chain(system + "Hi")) == 4
    assert prefix_chain(system + "Hi") == prefix_chain(system + "Bye")
    assert prefix_chain(system + "Hi")[:3] == prefix_chain(system[:200] + "!" * 70)[:3]
    assert prefix_chain(system, chars_per_block=16)[:4] != prefix_chain(system)[:4]
    assert len(prefix_chain(tuple(range(100)))) == 6
    assert len(prefix_chain(tuple(range(100)), tokens_per_block=32)) == 3
    assert prefix_chain(tuple(range(100)))[:2] == prefix_chain(tuple(range(32)))
    # a text and token ids never share a key, even with the same bytes in them
    assert not set(prefix_chain("a" * 640)) & set(prefix_chain((97,) * 640))
    p = PrefixAffinity()
    home = p.choose(system + "Hi", idle(2)).index
    assert p.choose(system + "Bye", idle(2)) == Pick(home, "prefix", 4)
    assert p.choose(tuple(ord(c) for c in system), idle(2)).reason == "load"
    # ids outside any vocabulary, or huge, are hashed, not refused
    assert len(prefix_chain((-1, 2**70) * B)) == 2


def test_the_key_is_stable_and_an_idle_fleet_spreads_new_groups() -> None:
    p = PrefixAffinity()
    homes = [p.choose(ids(2, group=g), idle(2)).index for g in range(40)]
    assert 18 <= homes.count(0) <= 22  # even by the blocks each holds, not all on 0
    again = PrefixAffinity()
    assert homes == [again.choose(ids(2, group=g), idle(2)).index
                     for g in range(40)]  # the same in a new router with the same history
    # a fresh router's first choice is the hash's: both replicas get some groups
    firsts = [PrefixAffinity().choose(ids(2, group=g), idle(2)).index for g in range(40)]
    assert 10 <= firsts.count(0) <= 30
    # the replica holding fewer blocks gets the next new group
    q = PrefixAffinity()
    big = q.choose(ids(20, group=1), idle(2)).index
    assert all(q.choose(ids(2, group=g), idle(2)).index == 1 - big for g in range(2, 9))


def test_memory_stays_bounded_under_a_flood_of_unique_prompts() -> None:
    p = PrefixAffinity(memory_blocks=64, max_blocks=8)
    for i in range(3000):
        p.choose(tuple(range(i * 200, i * 200 + 17 * B)), idle(2))
        p.choose(f"{i:08d}" * 100, idle(2))
        assert p.remembered() <= 2 * 64
    assert len(prefix_chain(tuple(range(10**5)), max_blocks=8)) == 8
    # a group routed after the flood is still found
    home = p.choose(ids(4, group=99), idle(2)).index
    assert p.choose(ids(4, group=99, tail=1), idle(2)) == Pick(home, "prefix", 4)


def test_forget_drops_a_restarted_replicas_prefixes() -> None:
    p = PrefixAffinity()
    home = p.choose(ids(2, group=5), idle(2)).index
    p.forget(home)
    p.forget(17)  # never seen: nothing to do
    assert p.choose(ids(2, group=5, tail=1), idle(2)).reason == "load"


def test_long_prompts_get_their_own_lane() -> None:
    p = PrefixAffinity(long_prompt=256, long_replicas=1)
    long, short = ids(16, group=1), ids(4, group=2)  # 272 and 80 ids
    for _ in range(3):  # the long lane is the highest index, whatever the load
        assert p.choose(long, loads(0, 5, 6)).index == 2
        assert p.choose(short, loads(3, 1, 0)).index in (0, 1)
    assert p.choose(ids(4, group=3), loads(3, 1, 0)) == Pick(1, "load", 0)  # lane: least
    assert p.choose("w" * 1024, loads(0, 0, 0)).index == 2  # text: 4 characters a token
    assert p.choose("w" * 1000, loads(0, 0, 0)).index in (0, 1)
    # the lane full, or too few replicas for two lanes: every ready replica
    assert p.choose(long, loads(0, 1, 8)).index == 0
    assert p.choose(long, loads(0, 1, 0, ready=(True, False, False))).reason == "only"
    two = PrefixAffinity(long_prompt=256, long_replicas=2)
    assert two.choose(short, loads(2, 0)).index == 1


def test_bad_settings_are_refused() -> None:
    for kw in ({"tokens_per_block": 0}, {"chars_per_block": 0}, {"memory_blocks": 0},
               {"max_blocks": 0}, {"load_margin": -0.1}, {"load_margin": 2.0},
               {"long_prompt": -1}, {"long_replicas": 0}):
        with pytest.raises(ValueError):
            PrefixAffinity(**kw)  # type: ignore[arg-type]


def test_choose_explains_every_picker() -> None:
    assert choose(LeastLoaded(), "x", loads(2, 1)) == Pick(1, "load")
    rr = RoundRobin()
    assert [choose(rr, "x", idle(3)) for _ in range(4)] == [
        Pick(0, "turn"), Pick(1, "turn"), Pick(2, "turn"), Pick(0, "turn")]
    assert make_picker("prefix").choose(ids(1, group=1), idle(2)).index in (0, 1)
    assert all(c.reason in balance.REASONS for c in (choose(make_picker(n), "y" * 100, idle(2))
                                                     for n in balance.PICKERS))


# -- the routing key of hostile bodies ---------------------------------------------------

def test_prompt_of_reads_completions_and_chats() -> None:
    assert prompt_of({"prompt": "hello"}) == "hello"
    assert prompt_of({"prompt": [1, 2, 3]}) == (1, 2, 3)
    assert prompt_of({"prompt": ["first", "second"]}) == "first"
    assert prompt_of({"prompt": [[4, 5], [6]]}) == (4, 5)
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                      {"type": "image_url"},
                                                      {"type": "text", "text": " there"}]}]}
    assert prompt_of(chat) == "system\x1fBe brief.\x1euser\x1fHi there"


@pytest.mark.parametrize("body", [
    None, 3, "prompt", [1, 2], {}, {"prompt": None}, {"prompt": []}, {"prompt": [True, 1]},
    {"prompt": [1, "x"]}, {"prompt": [1.5]}, {"prompt": [[True]]}, {"prompt": [None, "x"]},
    {"prompt": {"a": 1}}, {"messages": "hi"}, {"messages": {"role": "user"}},
    {"messages": None}, {"prompt": [[[[[]]]]]},
])
def test_prompt_of_keys_junk_as_the_empty_prompt(body: object) -> None:
    assert prompt_of(body) == ""


def test_prompt_of_skips_junk_inside_messages() -> None:
    body = {"messages": [1, None, "x", [], {"role": {"nested": [1]}, "content": 5},
                         {"role": "user" * 1000, "content": [{"text": 7}, "t", {"text": "ok"}]}]}
    key = prompt_of(body)
    assert key == "\x1f\x1e" + "user" * 16 + "\x1fok"


def test_prompt_of_caps_huge_prompts() -> None:
    assert len(prompt_of({"prompt": "x" * 5_000_000})) == prompt.MAX_CHARS
    key = prompt_of({"prompt": list(range(1_000_000))})
    assert isinstance(key, tuple) and len(key) == prompt.MAX_TOKENS
    many = {"messages": [{"role": "user", "content": "y" * 1000}] * 100_000}
    assert len(prompt_of(many)) <= prompt.MAX_CHARS
    empty = {"messages": [{}] * 1_000_000}  # each message adds 2 characters at most
    assert len(prompt_of(empty)) <= 2 * prompt.MAX_ITEMS
    parts = {"messages": [{"role": "user", "content": [{"text": "z" * 100}] * 1_000_000}]}
    assert len(prompt_of(parts)) <= prompt.MAX_CHARS
    assert len(prefix_chain(prompt_of({"prompt": "x" * 5_000_000}))) == 128


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["prompt", "messages", "role", "content", "text", "x"]) | st.text(
            max_size=5), inner, max_size=5),
    max_leaves=12)


@settings(max_examples=100, deadline=None)
@given(JSON)
def test_prompt_of_never_raises_on_any_json(body: object) -> None:
    key = prompt_of(body)
    assert isinstance(key, str) or all(type(t) is int for t in key)
    PrefixAffinity().choose(key, idle(2))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(0, 3),
                          st.lists(st.integers(0, 9), min_size=3, max_size=3),
                          st.lists(st.booleans(), min_size=3, max_size=3)), max_size=60))
def test_prefix_picks_a_ready_replica_and_its_memory_stays_bounded(
        steps: list[tuple[int, int, int, list[int], list[bool]]]) -> None:
    p = PrefixAffinity(memory_blocks=10, max_blocks=4)
    for group, blocks, tail, inflight, ready in steps:
        replicas = [ReplicaLoad(i, n, 8, r) for i, (n, r) in enumerate(zip(inflight, ready))]
        if not any(ready):
            continue
        got = p.choose(ids(blocks, group, tail), replicas)
        assert replicas[got.index].ready and got.reason in balance.REASONS
        assert got.matched_blocks <= min(blocks + 1, 4)  # + the tail's block
        assert p.remembered() <= 3 * 10
