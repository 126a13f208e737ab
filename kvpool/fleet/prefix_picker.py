"""Prefix-affinity routing (``routing = "prefix"``): send a request to the replica that
was sent the longest prefix of its prompt, where that prefix's KV is likely still in the
prefix cache, unless that replica is busy.

The picker keeps, per replica, the chain keys (:mod:`kvpool.fleet.prefix_key`) of the
prompts it routed there, in a bounded LRU (:class:`RoutedPrefixes`): an estimate of the
replica's prefix cache that needs no call to the replica. It remembers a prompt when it
picks (not when the request finishes), so the next request of the same prefix group,
even one that arrives in the same instant, follows the first.

Choice, for a prompt with keys ``k0..kn`` among the ready replicas:

1. One ready replica: that one (reason ``only``).
2. Replicas that are not *saturated*: not full (``inflight < capacity``) and not more
   than ``load_margin * capacity`` requests (at least one) above the least-loaded
   replica's load. Among those, the one holding the longest match (ties: lower load,
   then lower index) if that match is at least one block (reason ``prefix``).
3. Else the least-loaded replica (reason ``load``); among replicas equally loaded (an
   idle fleet), the one that holds fewer remembered keys (a smaller share of the
   prefixes: new groups fill the caches evenly), then a rendezvous hash of the
   prompt's deepest key.

Optional lanes (``long_prompt`` > 0): a prompt of at least ``long_prompt`` tokens (text:
its characters / 4) goes to the ``long_replicas`` highest-index ready replicas, a
shorter one to the others, so long prefills do not stall short requests' decoding; the
rule above applies inside the lane. With too few ready replicas for two lanes, or every
replica of the lane full, all ready replicas are the lane.

Why least-loaded and not a consistent hash of the first block for a prefix nobody holds:
the memory already keeps a group together once its first request is placed, so the hash
is not needed for that; a hash of the first block would send every prompt that starts
with the same preamble (a chat template's system line) to one replica, and it ignores
load. On an idle fleet the tie-break spreads new groups by the size of what each
replica holds (instead of all landing on replica 0 and overflowing its cache; a hash
alone split the benchmark's twelve groups 239:79 blocks, more than one cache holds),
and the hash makes the choice the same in every router given the same history.

Memory: at most ``memory_blocks`` keys per replica index (about 100 bytes each), whatever
the traffic: a flood of unique prompts only evicts older keys. Work per request: at
most ``max_blocks`` hashes and ``max_blocks`` lookups per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

from kvpool.fleet.loads import Pick, ReplicaLoad, least_loaded, ready_replicas
from kvpool.fleet.prefix_key import prefix_chain
from kvpool.fleet.prompt import Prompt


class RoutedPrefixes:
    """The chain keys routed to one replica, least recently routed first, at most
    ``capacity`` of them (the oldest are dropped)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a chain, root first) are held, counting from the root."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def remember(self, keys: Sequence[int]) -> None:
        """Hold ``keys``, as the most recently routed; the root is touched last, so that
        a prefix shared by many prompts is the last to go."""
        held = self._keys
        for k in reversed(keys):
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
        while len(held) > self.capacity:
            held.popitem(last=False)


class PrefixAffinity:
    """The picker registered as ``"prefix"`` (see the module docstring for the rule).

    ``chars_per_block`` / ``tokens_per_block``: the block of a text / token-id prompt
    (the engines' block size is 16 tokens); ``max_blocks``: blocks of a prompt keyed;
    ``memory_blocks``: keys remembered per replica; ``load_margin``: how much busier
    than the least-loaded replica (a fraction of its capacity, at least one request)
    the replica holding the prefix may be and still be chosen; ``long_prompt`` (tokens,
    0: off) and ``long_replicas``: the lanes for long prompts."""

    def __init__(self, *, chars_per_block: int = 64, tokens_per_block: int = 16,
                 max_blocks: int = 128, memory_blocks: int = 8192,
                 load_margin: float = 0.25, long_prompt: int = 0,
                 long_replicas: int = 1) -> None:
        if min(chars_per_block, tokens_per_block, max_blocks, memory_blocks,
               long_replicas) < 1 or long_prompt < 0:
            raise ValueError("block sizes, max_blocks, memory_blocks and long_replicas "
                             "must be positive, long_prompt not negative")
        if not 0.0 <= load_margin <= 1.0:
            raise ValueError(f"load_margin must be in [0, 1], not {load_margin!r}")
        self.long_prompt = long_prompt
        self.long_replicas = long_replicas
        self.chars_per_block = chars_per_block
        self.tokens_per_block = tokens_per_block
        self.max_blocks = max_blocks
        self.memory_blocks = memory_blocks
        self.load_margin = load_margin
        self._routed: dict[int, RoutedPrefixes] = {}

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick:
        """The replica for ``prompt`` and why; remembers the prompt's prefix there."""
        ready = ready_replicas(replicas)
        keys = prefix_chain(prompt, chars_per_block=self.chars_per_block,
                            tokens_per_block=self.tokens_per_block, max_blocks=self.max_blocks)
        matched = {r.index: self._memory(r.index).match(keys) for r in ready}
        if len(ready) == 1:
            chosen, reason = ready[0], "only"
        else:
            ready = self._lane(prompt, ready)
            least = least_loaded(ready)
            fit = [r for r in ready if not self._saturated(r, least)] or [least]
            top = max(matched[r.index] for r in fit)
            if top > 0:
                chosen = min((r for r in fit if matched[r.index] == top),
                             key=lambda r: (r.load, r.index))
                reason = "prefix"
            else:
                tied = [r for r in ready if r.load == least.load]
                chosen = min(tied, key=lambda r: (len(self._memory(r.index)),
                                                  _rendezvous(keys, r.index))) if keys else least
                reason = "load"
        self._memory(chosen.index).remember(keys)
        return Pick(chosen.index, reason, matched[chosen.index])

    def forget(self, index: int) -> None:
        """Drop what was routed to replica ``index`` (its server restarted: its prefix
        cache is empty). Optional for the router; without it the memory ages out."""
        self._routed.pop(index, None)

    def remembered(self) -> int:
        """Keys held over all replicas (at most ``memory_blocks`` per replica index)."""
        return sum(len(m) for m in self._routed.values())

    def _memory(self, index: int) -> RoutedPrefixes:
        memory = self._routed.get(index)
        if memory is None:
            memory = self._routed[index] = RoutedPrefixes(self.memory_blocks)
        return memory

    def _lane(self, prompt: Prompt, ready: list[ReplicaLoad]) -> list[ReplicaLoad]:
        """The ready replicas that serve ``prompt``'s length (all without lanes)."""
        if not self.long_prompt or len(ready) <= self.long_replicas:
            return ready
        tokens = len(prompt) // 4 if isinstance(prompt, str) else len(prompt)
        by_index = sorted(ready, key=lambda r: r.index)
        cut = len(by_index) - self.long_replicas
        lane = by_index[cut:] if tokens >= self.long_prompt else by_index[:cut]
        return lane if any(r.inflight < r.capacity for r in lane) else ready

    def _saturated(self, r: ReplicaLoad, least: ReplicaLoad) -> bool:
        if r.inflight >= r.capacity:
            return True
        slack = max(1.0, self.load_margin * r.capacity)  # requests
        return (r.load - least.load) * r.capacity > slack


def _rendezvous(keys: Sequence[int], index: int) -> bytes:
    """A replica's score for a prompt (lowest wins), the same in every process."""
    return blake2b(keys[-1].to_bytes(8, "little") + index.to_bytes(8, "little", signed=True),
                   digest_size=8).digest()
