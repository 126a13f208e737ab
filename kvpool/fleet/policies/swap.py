"""``policy = "swap"``: load on demand, unload when memory is needed (Ollama's scheduler,
llama-swap), a baseline.

Where it comes from (docs/ARCHITECTURE.md, "Fleet policies"; Ollama's ``server/sched.go``
and its FAQ): a model loads on its first request, nothing at start; each loaded model
allocates its context up front (``num_ctx`` x ``OLLAMA_NUM_PARALLEL`` slots of KV); a
loaded model stays ``keep_alive`` after its last request (default 5 min; negative:
forever; 0: unloaded right after its answer); when a model must load and does not fit,
idle models are unloaded, least recently used first; ``OLLAMA_MAX_LOADED_MODELS`` caps
the count (default 3 per GPU: one device here). Unloading stops the runner process,
which frees everything.

Here: every member is ``kvpool serve`` *without* ``--elastic`` (vLLM: without the kvpool
plugin, ``--kv-cache-memory-bytes``): its weights in its own memory and a static KV of
the entry's ``kv_cache_size`` (the context x slots), nothing in the daemon's pool.
Nothing arbitrates between them, so this policy accounts the budget itself: a member's
footprint is its weights as its server holds them plus its static KV, and a member
starts only when the loaded ones' footprints and its own fit the daemon's budget and
fewer than ``max_loaded`` are loaded; otherwise the least recently used idle members
are unloaded (their processes stopped) until it fits, or, when the busy ones leave too
little, the request waits for one of them to become idle (a member whose request ends
makes the waiting requests look again). A member is idle when it serves no request of
the fleet's; *loaded* is every member with a process (starting, awake, hung, or being
unloaded: its memory is held until its process is gone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvpool.fleet.checkpoint import holds_float32, inspect
from kvpool.fleet.entries import ModelEntry
from kvpool.fleet.member import ASLEEP, AWAKE, FAILED, HUNG, STARTING, Member, MemberState
from kvpool.fleet.policies.base import (Control, Knob, PolicyError, PolicyRun, Setup,
                                        daemon_budget, last_used)
from kvpool.sizes import format_size

KEEP_ALIVE = Knob("keep_alive", 300.0, 0.0, 31_536_000.0, "seconds", forever=-1.0)
MAX_LOADED = Knob("max_loaded", 3, 1, 1000, "models", integer=True)
#: states of a member whose process holds its memory
HOLDING: tuple[MemberState, ...] = (STARTING, AWAKE, ASLEEP, HUNG)


@dataclass(frozen=True)
class Loaded:
    """A loaded member as the plan sees it: its footprint, whether it serves nothing
    (``idle``: it may be unloaded), when it last served, whether it is on its way out."""

    key: str
    nbytes: int
    idle: bool
    last_used: float
    leaving: bool = False


@dataclass(frozen=True)
class Plan:
    """``start``: the new member fits now. Else ``unload`` (least recently used first)
    makes it fit once they are gone; None: it cannot fit until a busy one is idle."""

    start: bool
    unload: tuple[str, ...] | None = ()


def plan_load(loaded: Sequence[Loaded], need: int, budget: int, max_loaded: int) -> Plan:
    """Whether a member of ``need`` bytes may load beside ``loaded`` (see the module):
    it fits when every loaded footprint plus ``need`` is within ``budget`` and fewer than
    ``max_loaded`` are loaded; else the fewest least-recently-used idle members whose
    unloading (with those already leaving) makes it fit. Pure."""
    if sum(x.nbytes for x in loaded) + need <= budget and len(loaded) < max_loaded:
        return Plan(start=True)
    staying = [x for x in loaded if not x.leaving]
    used, count = sum(x.nbytes for x in staying), len(staying)
    victims: list[str] = []
    for x in sorted((x for x in staying if x.idle), key=lambda x: (x.last_used, x.key)):
        if used + need <= budget and count < max_loaded:
            break
        victims.append(x.key)
        used -= x.nbytes
        count -= 1
    if used + need <= budget and count < max_loaded:
        return Plan(start=False, unload=tuple(victims))
    return Plan(start=False, unload=None)


class SwapRun:
    """Swap for one fleet: the budget read from the daemon, each model's footprint,
    the members being unloaded."""

    def __init__(self, keep_alive: float, max_loaded: int, budget: int,
                 footprints: Mapping[str, int]) -> None:
        self.keep_alive = keep_alive  # negative: forever
        self.max_loaded = max_loaded
        self.budget = budget
        self.footprints = dict(footprints)  # model -> bytes of one member
        self.leaving: set[str] = set()  # tenants being unloaded
        self.waits_said: set[str] = set()  # tenants whose wait was logged (once per wait)
        self.tasks: set[asyncio.Task[None]] = set()

    def holds(self, m: Member) -> bool:
        """``m`` holds its footprint: it has a process (or is being unloaded)."""
        if m.tenant in self.leaving or m.state in HOLDING:
            return True
        return m.state == FAILED and m.exit_code() is None and m.popen is not None

    def loaded(self, fleet: Control) -> list[Loaded]:
        return [Loaded(m.tenant, self.footprints[m.model],
                       idle=m.state == AWAKE and m.inflight == 0 and m.tenant not in self.leaving,
                       last_used=last_used(m), leaving=m.tenant in self.leaving)
                for m in fleet.all() if self.holds(m)]

    def may_start(self, m: Member, fleet: Control) -> bool:
        if m.tenant in self.leaving:
            return False
        need = self.footprints[m.model]
        loaded = self.loaded(fleet)
        plan = plan_load(loaded, need, self.budget, self.max_loaded)
        if plan.start:
            self.waits_said.discard(m.tenant)
            return True
        if plan.unload is None:
            if m.tenant not in self.waits_said:
                self.waits_said.add(m.tenant)
                held = sum(x.nbytes for x in loaded)
                fleet.say(f"fleet: swap: {m.tenant} ({format_size(need)}) waits: "
                          f"{len(loaded)} loaded (at most {self.max_loaded}) hold "
                          f"{format_size(held)} of {format_size(self.budget)} and too few "
                          f"are idle")
            return False
        by_tenant = {x.tenant: x for x in fleet.all()}
        for key in plan.unload:
            self._unload(fleet, by_tenant[key], f"least recently used idle model; "
                                                f"{m.tenant} needs {format_size(need)}")
        return False

    def released(self, m: Member, fleet: Control) -> None:
        """A member went idle: a request waiting for room looks again (and the
        ``keep_alive`` timer starts over)."""
        fleet.poke()

    def _unload(self, fleet: Control, m: Member, why: str) -> None:
        self.leaving.add(m.tenant)

        async def unload() -> None:
            try:
                await fleet.unload(m, why)
            finally:
                self.leaving.discard(m.tenant)
                fleet.poke()  # its memory is free: waiting requests look again

        task = asyncio.create_task(unload(), name=f"fleet-swap-unload-{m.tenant}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, fleet: Control) -> None:
        """``keep_alive``: a member idle that long is unloaded (woken by every change of
        state and every request's end, else at the next expiry)."""
        try:
            while not fleet.closed:
                now = time.monotonic()
                due: list[float] = []
                for m in fleet.all():
                    if self.keep_alive < 0 or m.state != AWAKE or m.inflight \
                            or m.tenant in self.leaving:
                        continue
                    at = last_used(m) + self.keep_alive
                    if at <= now:
                        self._unload(fleet, m, f"idle for keep_alive ({self.keep_alive:g} s)")
                    else:
                        due.append(at)
                await fleet.wait_change(min(due) - now if due else 3600.0)
        finally:
            for task in list(self.tasks):
                task.cancel()


class SwapPolicy:
    """Load on demand, unload the least recently used idle model (see the module)."""

    name = "swap"
    source = ("Ollama's scheduler (server/sched.go: keep_alive, OLLAMA_MAX_LOADED_MODELS, "
              "LRU unload of idle runners) and llama-swap")
    knobs: tuple[Knob, ...] = (KEEP_ALIVE, MAX_LOADED)
    decides: tuple[str, ...] = ("eager", "sleepable", "sleep_after", "min", "max", "shares",
                                "weights")
    baseline = True
    elastic = False
    daemon_settings: Mapping[str, str] = MappingProxyType({})

    def member(self, entry: ModelEntry) -> ModelEntry:
        return dataclasses.replace(entry, eager=False, sleepable=False, sleep_after=None,
                                   min=None, max=None, shares=None, weights="local")

    def start(self, knobs: Mapping[str, float], setup: Setup) -> PolicyRun:
        """Reads the daemon's budget; every model must fit it alone."""
        budget = daemon_budget(setup)
        footprints = {e.name: footprint(e, setup.backend) for e in setup.entries}
        for name, nbytes in footprints.items():
            if nbytes > budget:
                raise PolicyError(f"policy swap: model {name} needs {format_size(nbytes)} "
                                  f"(weights and its static KV), more than the budget "
                                  f"({format_size(budget)})")
        return SwapRun(knobs["keep_alive"], int(knobs["max_loaded"]), budget, footprints)


def footprint(entry: ModelEntry, backend: str) -> int:
    """A swap member's bytes: its weights as its server holds them (the checkpoint's
    weight files, doubled for 16-bit weights held in float32) plus its static KV."""
    try:
        info = inspect(entry.checkpoint, entry.engine, holds_float32(backend, entry.args,
                                                                   entry.engine))
    except ValueError as e:
        raise PolicyError(f"policy swap: model {entry.name}: {e}") from None
    return info.weight_bytes + entry.kv_cache_size
