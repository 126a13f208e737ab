"""The fleet-policy seam: a :class:`FleetPolicy` (one per ``[fleet] policy`` name), its
knobs (:class:`Knob`), what it runs while the fleet serves (:class:`PolicyRun`) and what
it may do to the fleet's members (:class:`Control`, the supervisor's side).

A policy decides four things and nothing else: how its members are started (the
entry's knobs it sets itself, :meth:`FleetPolicy.member`, and whether their KV is elastic),
which members start with the fleet (the member entries' ``eager``), whether a member may
start now (:meth:`PolicyRun.may_start`: a policy that accounts memory itself says no until
it fits), and what it does on its own clock (:meth:`PolicyRun.run`: unloads, sleeps,
ceilings). Routing, waking a sleeping member for a request, watching and restarting are
the fleet's, the same under every policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvpool.fleet.entries import ModelEntry
from kvpool.fleet.member import Member


class PolicyError(RuntimeError):
    """A policy cannot run with this fleet (a model that can never fit its budget, no
    daemon to read the budget from); one line."""


@dataclass(frozen=True)
class Knob:
    """One ``[fleet]`` key of a policy: a number in ``lo..hi`` (``lo`` itself excluded when
    ``lo_open``), an integer when ``integer``; ``forever``: one value outside the range
    that is accepted too and means "never" (Ollama's negative ``keep_alive``)."""

    name: str
    default: float
    lo: float
    hi: float
    unit: str  # "seconds", "percent", "models": for the messages and the docs
    integer: bool = False
    lo_open: bool = False
    forever: float | None = None

    def problem(self, value: float) -> str | None:
        """Why ``value`` is refused (one phrase), or None."""
        if self.forever is not None and value == self.forever:
            return None
        if not math.isfinite(value):
            return f"{value!r} is out of range"
        if self.integer and value != int(value):
            return f"{_num(value)} is not a whole number of {self.unit}"
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not low_ok or value > self.hi:
            also = f", or {_num(self.forever)} for never" if self.forever is not None else ""
            return (f"{_num(value)} is out of range ({'more than ' if self.lo_open else ''}"
                    f"{_num(self.lo)} to {_num(self.hi)} {self.unit}{also})")
        return None


def _num(x: float) -> str:
    """``x`` as a fleet file would write it (``300``, ``0.5``)."""
    return str(int(x)) if math.isfinite(x) and x == int(x) else repr(x)


@dataclass(frozen=True)
class Setup:
    """What a policy gets to start with: the daemon's run directory, the daemon's
    backend (how a server holds its weights), the fleet's name (its members' group), the
    models as the policy starts them (:meth:`FleetPolicy.member`) and the fleet's log."""

    run_dir: Path
    backend: str
    group: str
    entries: tuple[ModelEntry, ...]
    say: Callable[[str], None]


class Control(Protocol):
    """What a policy may do to the fleet (the :class:`~kvpool.fleet.supervisor.Supervisor`
    implements it). Only the fleet's event loop calls these."""

    closed: bool
    say: Callable[[str], None]

    def all(self) -> list[Member]: ...

    async def wait_change(self, timeout_s: float) -> None: ...

    def poke(self) -> None:
        """Wake whoever waits in :meth:`wait_change` (requests waiting for a member
        re-check whether it may start)."""

    async def unload(self, m: Member, why: str) -> None:
        """Stop ``m``'s server (its process group; every byte it held is freed):
        ``stopped``. Its state changes at once (nothing is routed to it, nothing
        restarts it); returns once the process is gone."""

    async def put_to_sleep(self, m: Member, why: str) -> bool:
        """``POST /sleep`` to ``m``'s server; True once asleep (False: it is busy, or it
        did not answer; one log line)."""


class PolicyRun(Protocol):
    """A policy while the fleet serves.

    Caller's obligations: :meth:`may_start` is asked before every start of a member that
    is stopped (or failed long enough ago), and :meth:`released` told of every member
    whose requests in flight went to none, from the event loop; :meth:`run` runs as one
    task from the fleet's start until its close (cancelled then)."""

    def may_start(self, m: Member, fleet: Control) -> bool: ...

    def released(self, m: Member, fleet: Control) -> None:
        """``m``'s last request in flight of the fleet's ended."""

    async def run(self, fleet: Control) -> None: ...


class FleetPolicy(Protocol):
    """One ``[fleet] policy``, registered by name in
    :data:`kvpool.fleet.policies.FLEET_POLICIES`.

    ``source`` says where its behaviour comes from (one line, shown in the docs);
    ``knobs`` are its ``[fleet]`` keys; ``decides`` the model keys it sets itself (a fleet
    file may give them only with the value the policy sets); ``baseline``: it runs only on a
    daemon of its own (``--with-daemon``), started with ``daemon_settings`` (the daemon
    config keys its behaviour needs); ``elastic``: its members' KV lives in the daemon's
    pool (else a static KV in the server's own memory)."""

    name: str
    source: str
    knobs: tuple[Knob, ...]
    decides: tuple[str, ...]
    baseline: bool
    elastic: bool
    daemon_settings: Mapping[str, str]

    def member(self, entry: ModelEntry) -> ModelEntry:
        """The entry as this policy starts its members (its own knobs set)."""

    def start(self, knobs: Mapping[str, float], setup: Setup) -> PolicyRun:
        """The policy with these knob values (every knob of :attr:`knobs`, checked) for
        one fleet; raises :class:`PolicyError` (one line) when it cannot run."""


def daemon_budget(setup: Setup) -> int:
    """The daemon's budget in bytes (what a baseline divides: the same as the kvpool
    fleet's); :class:`PolicyError` when the daemon does not answer."""
    from kvpool.client_lib import Monitor

    try:
        with Monitor(setup.run_dir) as monitor:
            return monitor.stats().pool.budget
    except Exception as e:  # (no daemon, refused: one line either way)
        raise PolicyError(f"cannot read the daemon's budget at {setup.run_dir}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def last_used(m: Member) -> float:
    """When ``m`` last served (monotonic): its last request's end, or when its server
    came up when it has served none since (not when it was spawned: a start slower than
    ``keep_alive`` or an idle threshold must not unload or sleep a member before the
    request that started it reaches it)."""
    return max(m.idle_since, m.started_at, m.up_at)
