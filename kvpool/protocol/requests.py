"""Every request a client sends on the control socket: one msgspec struct per ``op``.

Adding a request type: define its struct here (``tag`` = its op name), add it to
:data:`REQUESTS` (and to :data:`MONITOR_OPS`/:data:`ADMIN_OPS` when no tenant token is
needed), define its reply in :mod:`kvpool.protocol.replies`, re-export both from
:mod:`kvpool.protocol`, and register its handler in ``Arbiter.__init__``'s dispatch
table (:mod:`kvpool.daemon.arbiter`); ``kvpool.daemon.auth.authorize`` decides who may
send it.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union, get_args

from msgspec import Meta, Struct

from kvpool.protocol.bounds import (
    MAP_GROUPS, MAX_BYTES, MAX_GANG_GROUPS, MAX_GROUPS, MAX_ID, MAX_NAME, MAX_RANKS,
    MAX_REGIONS, MAX_UNITS, VERSION, Bytes, ChunkUnits, Device, EngineType, GangToken, Id,
    Kind, Name,
    Rank, Seq, Shares, Token, Unit, Units,
)
from kvpool.protocol.endpoint import Endpoint


# ====================================================================== requests
class Request(Struct, tag_field="op", kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every request. ``token`` is the session token (empty for monitor ops)."""

    id: Id = 0
    token: Token = ""


class GangGroup(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One group of a gang's layout: every rank creates its ``k``-th group with exactly
    these values (``CreateGroup``), so a unit means the same bytes on every rank."""

    n_regions: Annotated[int, Meta(ge=1, le=MAX_REGIONS)]
    capacity: Annotated[int, Meta(ge=1, le=MAX_BYTES)]


Layout = Annotated[list[GangGroup], Meta(min_length=1, max_length=MAX_GANG_GROUPS)]


class Register(Request, tag="register"):
    """Bind this ZeroMQ connection to the fd-channel session named by ``token``.

    A rank of a gang (tensor parallelism, :class:`CreateGang`) joins here: ``gang`` (the
    token rank 0 got), its ``rank`` (1..ranks-1), ``device`` (the gang's device of that
    rank) and the ``layout`` it will create (equal to the gang's)."""

    name: Name
    kind: Kind = "engine"
    device: Device = 0
    version: int = VERSION
    # the tenant's own knobs; used only when the daemon's config has no entry for ``name``
    min: Optional[Bytes] = None
    max: Optional[Bytes] = None
    shares: Optional[Shares] = None
    # where it serves (kvpool.protocol.endpoint: loopback http only), for Locate
    endpoint: Optional[Endpoint] = None
    # it may be put to sleep under memory pressure (kvpool.daemon.sleepers); the config's
    # ``[tenants.NAME] sleepable`` wins
    sleepable: Optional[bool] = None
    # a rank joining a gang (kvpool.daemon.gangs): all three or none
    gang: Optional[GangToken] = None
    rank: Optional[Rank] = None
    layout: Optional[Layout] = None
    # the group it belongs to (a fleet's name: KVPOOL_GROUP), shown by ``ps``; a label only
    group: Optional[Name] = None
    # the metrics dialect its ``endpoint`` serves (``vllm``: vLLM's own /metrics;
    # ``kvpool``: ``kvpool serve``'s): the router's engine type in the daemon's
    # endpoints file (kvpool.daemon.endpoints); a label only
    engine: Optional[EngineType] = None


class CreateGang(Request, tag="create_gang"):
    """Make this registered session rank 0 of a new gang of ``len(devices)`` ranks:
    rank ``r`` lives on ``devices[r]`` (``devices[0]`` is this session's device; no
    device twice); every rank creates the groups of ``layout``, in order. Answered
    ``GangCreated{gang}``: the token the other ranks join with (``Register.gang``).
    Grants and releases of the gang's groups are then *collective*: each rank sends the
    same one (same group index, same units) and the daemon applies it on every device
    at once, or on none."""

    devices: Annotated[list[Device], Meta(min_length=2, max_length=MAX_RANKS)]
    layout: Layout


class CreateGroup(Request, tag="create_group"):
    """Register ``n_regions`` equal regions of ``capacity`` bytes each (a multiple of the
    page size) reserved by the client at ``bases`` (informational: shown by ``map``).
    ``chunk_units``: how many units the client grants and releases together (its
    allocator's chunk; informational: ``ps`` shows the bytes as the tenant's ``chunk``);
    at most the group's pages per region."""

    n_regions: Annotated[int, Meta(ge=1, le=MAX_REGIONS)]
    capacity: Annotated[int, Meta(ge=1, le=MAX_BYTES)]
    bases: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_ID)]], Meta(max_length=MAX_REGIONS)] = []
    label: Annotated[str, Meta(max_length=MAX_NAME)] = ""
    chunk_units: ChunkUnits = 1


class DestroyGroup(Request, tag="destroy_group"):
    """Forget a group; every unit still granted returns to the pool (unmap first)."""

    group: Id


class Grant(Request, tag="grant"):
    """Back ``units`` (virtual page indices, unmapped in the group) with fresh pages.

    ``in_use``/``reserve`` report the tenant's state *after* this request (bytes in use
    in the group; units of the group held as mapped-but-unused reserve).
    ``speculative`` grants (reserve refills) are served from free memory only: they never
    wait and never make the daemon reclaim from other tenants."""

    group: Id
    units: Units
    in_use: Optional[Bytes] = None
    reserve: Optional[Units] = None
    speculative: bool = False


class Release(Request, tag="release"):
    """Give back ``units`` of the group (the client has unmapped them everywhere)."""

    group: Id
    units: Units
    in_use: Optional[Bytes] = None
    reserve: Optional[Units] = None


class Report(Request, tag="report"):
    """Periodic state report for one group (same meaning as in :class:`Grant`)."""

    group: Id
    in_use: Optional[Bytes] = None
    reserve: Optional[Units] = None


class Lease(Request, tag="lease"):
    """Set this tenant's lease to ``bytes`` (0 ends it): memory the tenant uses through its
    own allocator, counted against the budget. Growing may wait for reclaim."""

    bytes: Bytes


class Reclaimed(Request, tag="reclaimed"):
    """The tenant finished handling :class:`Reclaim` ``seq``; ``freed`` bytes released."""

    seq: Seq
    freed: Bytes = 0


class AdoptGroup(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One group a tenant still maps after a daemon restart (its old id is kept)."""

    id: Annotated[int, Meta(ge=1, le=MAX_ID)]
    n_regions: Annotated[int, Meta(ge=1, le=MAX_REGIONS)]
    capacity: Annotated[int, Meta(ge=1, le=MAX_BYTES)]
    bases: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_ID)]], Meta(max_length=MAX_REGIONS)] = []
    label: Annotated[str, Meta(max_length=MAX_NAME)] = ""
    units: Units = []
    in_use: Optional[Bytes] = None
    reserve: Optional[Units] = None
    chunk_units: ChunkUnits = 1


class Adopt(Request, tag="adopt"):
    """After a daemon restart: everything this tenant still holds. ``nfds`` descriptors
    (unit-major per group, groups in order) were sent on the fd channel first. Accepted
    only while the daemon recovers, once, from a pid (and uid) the previous daemon
    recorded, and only if it all adds up (ids, units, budget, limit): otherwise
    ``UNAUTHORIZED``/``BAD_REQUEST`` with no effect. An empty Adopt is always accepted."""

    groups: Annotated[list[AdoptGroup], Meta(max_length=MAX_GROUPS)] = []
    lease: Bytes = 0
    nfds: Annotated[int, Meta(ge=0, le=1 << 20)] = 0


class Bye(Request, tag="bye"):
    """End the session: everything the tenant holds returns to the pool."""


class Ping(Request, tag="ping"):
    pass


class Ps(Request, tag="ps"):
    """List tenants (monitor op: no token needed)."""


class Stats(Request, tag="stats"):
    """Pool and tenant totals (monitor op)."""


class MapReq(Request, tag="map"):
    """Page tables of every group (or only ``tenant``'s, by name or id) plus the pool,
    groups in id order from the first one above ``after`` (paging: pass the reply's
    ``next``). Needs a registered session (any kind)."""

    tenant: Optional[Annotated[str, Meta(max_length=MAX_NAME)]] = None
    pfns: bool = False
    after: Id = 0
    limit: Annotated[int, Meta(ge=1, le=MAP_GROUPS)] = MAP_GROUPS  # groups per reply, at most


class SetLimit(Request, tag="set_limit"):
    """Set the knobs of every tenant called ``tenant`` (admin op; the session must belong
    to an admin identity). Unset fields are left as they are."""

    tenant: Name
    max: Optional[Bytes] = None
    min: Optional[Bytes] = None
    shares: Optional[Shares] = None


class Shutdown(Request, tag="shutdown"):
    """Stop the daemon (admin op). Tenants keep their mapped pages."""


class Check(Request, tag="check"):
    """Run the daemon's invariant check (read-only: a monitor op)."""


EVENTS_LIMIT = 1000  # events in one EventsReply, at most


class Events(Request, tag="events"):
    """The daemon's recent decisions with ``seq`` above ``since``, oldest first (monitor
    op; see :mod:`kvpool.daemon.events`). With ``follow`` and nothing new yet, the reply
    waits until there is (one such request per session; a newer one replaces it)."""

    since: Id = 0
    follow: bool = False
    tenant: Optional[Annotated[str, Meta(max_length=MAX_NAME)]] = None
    limit: Annotated[int, Meta(ge=1, le=EVENTS_LIMIT)] = EVENTS_LIMIT


# ---- page handoff (kvpool.daemon.handoff; docs/ARCHITECTURE.md "Page handoff") -------
TicketId = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]  # 128 random bits, hex
MAX_TTL_MS = 3_600_000  # an offer waits at most an hour
SomeUnits = Annotated[list[Unit], Meta(min_length=1, max_length=MAX_UNITS)]


class Offer(Request, tag="offer"):
    """Put ``units`` (granted, distinct, in no other pending ticket) of ``group`` in
    escrow for the tenant registered as ``to``, for ``ttl_ms``; answered ``Offered``
    with the ticket id. The giver keeps the pages until a claim succeeds, and must not
    write them meanwhile."""

    group: Id
    units: SomeUnits
    to: Name
    ttl_ms: Annotated[int, Meta(ge=1, le=MAX_TTL_MS)] = 10_000


class Claim(Request, tag="claim"):
    """Take ticket ``ticket`` into ``group`` at ``units`` (unmapped there, as many as the
    ticket holds: ``units[i]`` gets the ticket's ``i``-th unit); answered ``Claimed``
    (a ``Granted``: the descriptors precede it). The giver is told ``Settled``.
    ``giver`` (a tenant id; 0: any): the claimant expects the ticket to be that tenant's
    offer, and the daemon refuses (``UNAUTHORIZED``, nothing moves, the ticket stays
    pending for its giver) when it is another's — a successor that located its
    predecessor by name claims only what that tenant offered."""

    ticket: TicketId
    group: Id
    units: SomeUnits
    giver: Id = 0


class Cancel(Request, tag="cancel"):
    """The giver takes its pending offer back (``NOT_FOUND`` once it is settled)."""

    ticket: TicketId


class Locate(Request, tag="locate"):
    """Find the live tenant called ``name`` (its pid and registered endpoint), answered
    ``Located`` only when it may hand pages to the asker (same uid, or the config pairs
    it with the asker: the handoff rule); otherwise ``NOT_FOUND``, the same as for a
    name nobody holds (kvpool.daemon.locate). With ``as_giver`` the direction turns: the
    asker would hand pages to ``name`` (a retiring server checks who asks it to retire)."""

    name: Name
    as_giver: bool = False


# ---- weight sets (kvpool.daemon.weights; docs/ARCHITECTURE.md "Weight sets") -----------
# A set's content key: the sha256 hex digest of the checkpoint's tensors
# (kvpool.client_lib.weights.content_key), lower case, exactly 64 digits.
WeightKey = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class WeightCreate(Request, tag="weight_create"):
    """Create the weight set ``key`` of ``nbytes`` (rounded up to whole pages), held
    by this tenant while it loads the tensors: answered ``WeightGranted`` (the
    descriptors precede it, as for a grant). Nobody else sees the set until it is
    sealed; the creator's death or detach drops it. Refused when the key exists.
    ``mutable``: a set of two buffers of ``nbytes`` each (its descriptors: buffer 0's
    pages, then buffer 1's) with this tenant as its one writer and a version fence
    (kvpool.daemon.weight_fence): the writer keeps its writable mappings, readers map a
    published version read-only."""

    key: WeightKey
    nbytes: Annotated[int, Meta(ge=1, le=MAX_BYTES)]
    mutable: bool = False


class WeightSeal(Request, tag="weight_seal"):
    """The creator has loaded set ``key`` and unmapped every writable mapping of it: the
    daemon makes its pages read-only for good and the set attachable by its key. For a
    mutable set: both buffers are loaded and the writer keeps its writable mappings; no
    later writable mapping is possible (host: ``F_SEAL_FUTURE_WRITE``) and buffer 0 is
    published as version 1."""

    key: WeightKey


class WeightAttach(Request, tag="weight_attach"):
    """Hold the sealed set ``key``: answered ``WeightGranted`` with its descriptors,
    to be mapped read-only. ``write`` is always refused (a sealed set never changes)."""

    key: WeightKey
    write: bool = False


class WeightWrite(Request, tag="weight_write"):
    """The writer of mutable set ``key`` begins writing its back buffer (the one not
    published): answered ``WeightVersion`` (the current version, ``buffer`` the one to
    write). Refused ``UNAUTHORIZED`` to anyone but the writer, ``BUSY`` while a reader
    still reads that buffer (it has not switched to the current version yet)."""

    key: WeightKey


class WeightPublish(Request, tag="weight_publish"):
    """The writer has written the back buffer whole: it becomes the current version
    (answered ``WeightVersion``). Only after a ``WeightWrite``."""

    key: WeightKey


class WeightUse(Request, tag="weight_use"):
    """A reader of mutable set ``key`` has switched its mapping to ``version`` (the
    current one): it reads no other buffer from now on (answered ``WeightVersion``).
    A version other than the current one is refused."""

    key: WeightKey
    version: Annotated[int, Meta(ge=1, le=MAX_ID)]


class WeightDetach(Request, tag="weight_detach"):
    """Stop holding set ``key`` (unmap it first). The creator detaching a set it has
    not sealed drops the set."""

    key: WeightKey


# ---- sleep and wake (kvpool.daemon.sleepers; docs/ARCHITECTURE.md "Sleep and wake") ------
SaidState = Literal["busy", "idle", "asleep"]  # what a tenant may say it is doing
SleepReason = Literal["operator", "pressure", "idle", "request", "http"]  # why it slept or woke
SLEEP_STATES: tuple[SaidState, ...] = get_args(SaidState)
SLEEP_REASONS: tuple[SleepReason, ...] = get_args(SleepReason)


class SleepTenant(Request, tag="sleep_tenant"):
    """Ask every tenant called ``name`` to sleep (release all its KV and its weight-set
    holds), or with ``wake`` to wake up: the daemon sends each a ``SleepAsk`` and
    answers ``SleepAsked`` (``tenants`` 0: none connected). Needs a registered session
    of any kind (a monitor's is enough) whose uid is the tenants' own, or an admin's;
    another uid's tenant is refused (``UNAUTHORIZED``)."""

    name: Name
    wake: bool = False


class TenantState(Request, tag="tenant_state"):
    """The tenant says what it is doing: ``busy`` (serving), ``idle`` (may be put to
    sleep when it opted in), ``asleep`` (holds nothing until it wakes). The daemon
    records it and when it became idle; a sleep or wake is an event (with ``reason``)."""

    state: SaidState
    # why it went to sleep or woke (its own word, shown by ``kvpool events``): the
    # daemon's ask (operator, pressure), its idle timer, a request, its HTTP route
    reason: Optional[SleepReason] = None


class Room(Request, tag="room"):
    """What this session could be granted at once, and its knobs and the pool's free
    memory, answered ``RoomReply`` (kvpool.daemon.grants ``Grants.room``). Read-only and
    cheap (no page moves, no waiting): a server asks it when scraped for its metrics."""


REQUESTS = (
    Register, CreateGroup, DestroyGroup, Grant, Release, Report, Bye, Ping,
    Ps, Stats, MapReq, SetLimit, Check, Lease, Reclaimed, Adopt, Shutdown, Events,
    Offer, Claim, Cancel, Locate, WeightCreate, WeightSeal, WeightAttach, WeightDetach,
    WeightWrite, WeightPublish, WeightUse, SleepTenant, TenantState, CreateGang, Room,
)
AnyRequest = Union[REQUESTS]  # type: ignore[valid-type]  # built from the tuple for msgspec
MONITOR_OPS = frozenset({"ps", "stats", "map", "ping", "check", "events"})
ADMIN_OPS = frozenset({"set_limit", "shutdown"})
# ops any registered session may send (a monitor's too); the handler decides whose
# tenants it may act on (sleep_tenant: its own uid's, or any for an admin)
SESSION_OPS = frozenset({"sleep_tenant"})
