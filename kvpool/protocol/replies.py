"""Every reply the daemon sends on the control socket, tagged by ``r``, and the
read-only view structs (tenants, pool, page tables, events) some replies carry."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union, get_args

from msgspec import Struct

from kvpool.protocol.bounds import INTERNAL, Bytes, Kind
from kvpool.protocol.requests import SaidState

SessionKind = Literal[Kind, ""]  # a session's kind (Register.kind); "": not registered yet
# a tenant's state as ``ps`` shows it: what it said (TenantState), ``awake`` if it never did
ShownState = Literal["awake", SaidState]
ReclaimMode = Literal["reserve", "shrink"]  # what a Reclaim asks for (see Reclaim)
WeightSetState = Literal["loading", "sealed", "mutable"]  # a weight set's (kvpool.daemon.weights)


# ====================================================================== replies
class Reply(Struct, tag_field="r", kw_only=True, omit_defaults=True):
    """Base of every reply. ``id`` echoes the request (0: unsolicited)."""

    id: int = 0
    ok: bool = True


class Error(Reply, tag="error"):
    ok: bool = False
    code: str = INTERNAL
    message: str = ""


class Registered(Reply, tag="registered"):
    tenant: int
    name: str
    backend: str
    device: int
    page_size: int
    budget: int
    limit: int
    gang_id: int = 0  # the gang this session joined (0: none); never its token
    rank: int = 0


class GangCreated(Reply, tag="gang_created"):
    gang: str  # the token the other ranks join with (a capability: pass it privately)
    gang_id: int  # the gang's public id (ps, map, events)


class GangEnded(Reply, tag="gang_ended"):
    """Unsolicited (``id`` 0): a rank's session ended, so the gang ended; every rank's
    pages went back on every device and this session is being closed."""

    gang_id: int
    reason: str


class GroupCreated(Reply, tag="group"):
    group: int
    npages: int


class Granted(Reply, tag="granted"):
    group: int
    units: list[int]
    nfds: int


class Done(Reply, tag="done"):
    pass


class TenantInfo(Struct, kw_only=True):
    id: int
    name: str
    kind: SessionKind
    pid: int  # 0: not shown (another uid's tenant, to a non-admin asker)
    uid: int
    registered: bool
    groups: int
    mapped: int  # bytes granted (pages x page size)
    in_use: int  # bytes the client reports in use
    reserve: int  # bytes mapped but idle (client's reserve)
    min: int
    max: int
    shares: float  # its fair-share knob (a proportional count)
    lease: int = 0  # bytes leased (held outside kvpool's mappings)
    fair_share: int = 0  # its fair share of the budget right now (bytes), by ``shares``
    asked: int = 0  # bytes the daemon is waiting for this tenant to give back
    ignored: int = 0  # reclaims this tenant let expire
    unresponsive: bool = False  # capped at its min until it answers a reclaim
    waiting: int = 0  # bytes of this tenant's requests waiting for reclaim
    retained: int = 0  # bytes of pages it released but still references (charged to it)
    endpoint: str = ""  # where it says it serves (Register.endpoint; tenant-supplied)
    weights: int = 0  # bytes of the weight sets it holds (each counts against its max)
    weight_sets: list[str] = []  # the keys of those sets, first 12 hex digits each
    state: ShownState = "awake"  # busy | idle | asleep as it said (TenantState); awake: never
    sleepable: bool = False  # the daemon may put it to sleep under pressure
    device: int = 0  # the device it holds memory on
    gang: int = 0  # the gang it is a rank of (its id; 0: none)
    rank: int = 0
    group: str = ""  # the group it said it belongs to (Register.group: a fleet's name)
    # bytes one grant of its KV maps and one release frees (the allocation unit: its
    # groups' largest chunk, CreateGroup.chunk_units x regions x page size; 0: no group)
    chunk: int = 0


class PoolInfo(Struct, kw_only=True):
    backend: str
    device: int
    page_size: int
    budget: int  # bytes the daemon may hold in total
    granted: int  # bytes in tenants' page tables
    warm: int  # bytes of zeroed pages ready to grant
    dirty: int  # bytes released but not yet zeroed
    free: int  # budget - granted - warm - dirty
    created: int  # pages created since start
    warm_min: int
    warm_max: int
    leased: int = 0  # bytes of leases (counted against the budget)
    waiting: int = 0  # bytes asked by requests waiting for reclaim
    recovering: bool = False  # rebuilding its accounting after a restart (no grants)
    retained: int = 0  # bytes released by tenants that still reference them (charged)
    renewed: int = 0  # fresh pages created in place of released ones since start
    weights: int = 0  # bytes of weight sets, each counted once (in ``granted`` too)
    weights_cached: int = 0  # of which in sets nobody holds (reclaimed first)
    weight_sets: int = 0  # sets in the pool (loading or sealed)
    # an admin's sets are visible to every uid (the backend seals pages for good); False:
    # every set, an admin's too, is attachable by its creator's uid only (CUDA)
    weights_across_uids: bool = True


class Run(Struct, array_like=True):
    """``length`` consecutive virtual pages from ``start``, all mapped: in use, or idle
    reserve when ``reserve``. Unmapped pages are the gaps between runs."""

    start: int
    length: int
    reserve: bool = False


class GroupInfo(Struct, kw_only=True):
    id: int
    tenant: int
    tenant_name: str
    label: str
    n_regions: int
    npages: int
    bases: list[int]  # the first MAP_BASES region bases (informational; [] and no label
    #                   or pfns for another uid's group, unless the asker is an admin)
    runs: list[Run] = []  # the page table, run-length encoded (size: O(mapped units))
    pfns: Optional[dict[int, list[int]]] = None  # unit -> pfn per region (on request)
    chunk_units: int = 1  # units its client grants and releases together (CreateGroup)

    @property
    def in_use_units(self) -> int:
        return sum(r.length for r in self.runs if not r.reserve)

    @property
    def reserve_units(self) -> int:
        return sum(r.length for r in self.runs if r.reserve)

    def cells(self, start: int = 0, stop: int | None = None) -> str:
        """The table for virtual pages ``start..stop`` as text, one char per page: ``#``
        in use, ``+`` mapped reserve, ``.`` unmapped (decode only the slice you draw)."""
        stop = self.npages if stop is None else min(stop, self.npages)
        out = bytearray(b"." * max(0, stop - start))
        for r in self.runs:
            lo, hi = max(r.start, start), min(r.start + r.length, stop)
            if lo < hi:
                out[lo - start : hi - start] = (b"+" if r.reserve else b"#") * (hi - lo)
        return out.decode()

    @property
    def table(self) -> str:
        """The whole table as text (``cells()``); O(npages): prefer slices of ``cells``."""
        return self.cells()


class PsReply(Reply, tag="ps"):
    tenants: list[TenantInfo]
    pool: Optional[PoolInfo] = None
    # uid -> bytes of released pages still referenced, charged to that uid: its live
    # sessions' and its ended sessions' (which count against its later sessions' max)
    retained_by_uid: dict[int, int] = {}


class StatsReply(Reply, tag="stats"):
    pool: PoolInfo
    tenants: list[TenantInfo]
    uptime_s: float
    requests: int
    errors: int


class MapReply(Reply, tag="map"):
    """One page of the map. ``next`` is set when groups were left out (the reply stays
    under :data:`MAP_REPLY_BYTES`): ask again with ``after=next`` for the rest;
    ``truncated`` counts the groups left out of this reply."""

    pool: PoolInfo
    groups: list[GroupInfo]
    next: Optional[int] = None
    truncated: int = 0


class CheckReply(Reply, tag="check"):
    problems: list[str]


class Reclaim(Reply, tag="reclaim"):
    """Unsolicited (``id`` 0): the daemon asks the tenant to give back ``bytes``.

    ``mode`` is ``reserve`` (mapped-but-unused units only) or ``shrink`` (call the shrink
    callback to empty whole units); ``urgent`` means memory above ``min`` must go now
    (the engine may preempt). Answer with :class:`Reclaimed` ``seq`` within
    ``deadline_ms``."""

    bytes: int
    reason: str = ""
    seq: int = 0
    mode: ReclaimMode = "reserve"
    urgent: bool = False
    deadline_ms: int = 0


class LimitSet(Reply, tag="limit"):
    """``tenants`` is how many connected memory-holding tenants of that name the change
    applied to now; 0 means no such tenant is connected: the knobs are stored and apply
    when one registers. ``applied`` when every one of them is within its new knobs;
    otherwise ``pending`` bytes are being reclaimed."""

    tenant: str
    tenants: int = 0
    applied: bool = True
    pending: int = 0


class Leased(Reply, tag="leased"):
    bytes: int


class Adopted(Reply, tag="adopted"):
    groups: list[int]
    pages: int


class EventInfo(Struct, kw_only=True):
    """One decision of the daemon or memory move, on ``device``. ``kind``: grant,
    release, wait, deny, lease, ask (``mode`` reserve/shrink, or sleep: ``reason``
    operator or pressure), answer, reclaim (a whole round: ``detail`` has its asks and
    answers by tenant, and who was put to sleep), sleep and wake (``reason``: operator,
    pressure, idle, request, http or tenant; ``freed``/``took`` bytes), weights (a set
    created, sealed, attached, detached or evicted: ``op``, ``key``), limit, death and
    bye (the memory returned), handoff (pages a tenant claimed from a giver: ``detail``
    names the giver)."""

    seq: int
    time: float  # unix seconds
    kind: str
    tenant: str = ""
    tenant_id: int = 0
    bytes: int = 0
    detail: dict[str, Any] = {}
    device: int = 0


class EventsReply(Reply, tag="events"):
    """``next``: pass it as ``since`` to go on; ``lost``: events after ``since`` that
    the daemon's ring buffer no longer holds (a gap)."""

    events: list[EventInfo] = []
    next: int = 0
    lost: int = 0


# ---- page handoff (kvpool.daemon.handoff) -----------------------------------------------
SettledState = Literal["claimed", "expired", "cancelled"]  # how a handoff ticket ended
SETTLED_STATES: tuple[SettledState, ...] = get_args(SettledState)


class Offered(Reply, tag="offered"):
    ticket: str  # the capability the giver passes to the receiver (32 hex digits)
    pages: int  # units x regions in escrow
    ttl_ms: int


class Claimed(Granted, tag="claimed"):
    """The ticket's pages are the receiver's now (``units`` of ``group``; ``nfds``
    descriptors already on its fd channel, as for a grant). ``giver`` (its name) and
    ``giver_tenant`` (its tenant id, the daemon's) handed them."""

    ticket: str = ""
    giver: str = ""
    giver_tenant: int = 0


class Settled(Reply, tag="settled"):
    """Unsolicited (``id`` 0), to the giver: ticket ``ticket`` over ``units`` of
    ``group`` ended ``state`` (:data:`SETTLED_STATES`): ``claimed`` — unmap them (the
    receiver owns them; release nothing); ``expired``/``cancelled`` — they stay yours."""

    ticket: str
    state: SettledState
    group: int
    units: list[int]
    receiver: str = ""
    reason: str = ""


class Located(Reply, tag="located"):
    """The tenant a ``Locate`` named: its id, pid and uid (from ``SO_PEERCRED``) and the
    endpoint it registered (``""``: none; tenant-supplied, loopback http only)."""

    tenant: int
    name: str
    pid: int
    endpoint: str = ""
    uid: int = -1


class WeightGranted(Granted, tag="weights"):
    """The pages of weight set ``key`` (``nfds`` descriptors already on the fd channel,
    in page order; ``group`` 0, ``units`` empty): ``state`` ``loading`` (the creator
    maps them writable, loads, unmaps, seals) or ``sealed`` (map them read-only), or
    ``mutable`` (two buffers' pages: map buffer ``(version - 1) % 2`` read-only).
    ``nbytes`` is what was asked (per buffer); the pages cover it."""

    key: str = ""
    state: WeightSetState = "loading"
    nbytes: int = 0
    version: int = 0


class WeightVersion(Reply, tag="weight_version"):
    """A mutable set's fence (``WeightWrite``, ``WeightPublish``, ``WeightUse``): its
    current ``version`` and the ``buffer`` the request concerns (the one to write, or
    the one the version is in)."""

    version: int = 0
    buffer: int = 0


# ---- sleep and wake (kvpool.daemon.sleepers) --------------------------------------------------
class SleepAsked(Reply, tag="sleep_asked"):
    """The answer to ``SleepTenant``: ``tenants`` of that name were sent a ``SleepAsk``
    (0: none is connected)."""

    tenants: int = 0


class SleepAsk(Reply, tag="sleep_ask"):
    """Unsolicited (``id`` 0): go to sleep (release every KV page and weight-set hold),
    or with ``wake`` wake up; ``reason`` is ``operator`` (``kvpool sleep``/``wake``) or
    ``pressure`` (the daemon needs the memory for a waiting grant). Answer by reporting
    the new state (``TenantState``: ``asleep``, or ``idle`` when woken or refusing)."""

    wake: bool = False
    reason: str = ""
    seq: int = 0


class RoomReply(Reply, tag="room"):
    """The answer to ``Room``, about the asking session, in bytes. ``headroom``: what a
    grant of it would get at once (no reclaim, no wait): the least of the room under its
    cap (its max, or its min while unresponsive, less what it holds, waits for and is
    charged) and the pool's free memory not owed to waiting requests; 0 during
    recovery. ``granted``: what it holds (tables and lease); ``weights``: of the weight
    sets it holds; ``pool_free``: what any grant could get now (before waiters);
    ``state``: what it said (``ps``'s state). Every field is validated on decode like
    any reply (non-negative, bounded)."""

    headroom: Bytes = 0
    granted: Bytes = 0
    weights: Bytes = 0
    min: Bytes = 0
    max: Bytes = 0
    pool_free: Bytes = 0
    pool_budget: Bytes = 0
    state: ShownState = "awake"


REPLIES = (
    Error, Registered, GroupCreated, Granted, Done, PsReply, StatsReply, MapReply,
    CheckReply, Reclaim, LimitSet, Leased, Adopted, EventsReply, Offered, Claimed, Settled,
    Located, WeightGranted, WeightVersion, SleepAsked, SleepAsk, GangCreated, GangEnded, RoomReply,
)
AnyReply = Union[REPLIES]  # type: ignore[valid-type]  # built from the tuple for msgspec
