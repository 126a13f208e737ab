"""The kvpool wire protocol: every control message as a typed msgspec schema.

Transport (see DESIGN.md "Wire"):

* **control** — ZeroMQ. The daemon binds a ROUTER at ``ipc://$RUN_DIR/control.sock``;
  each client connects a DEALER and sends one frame per request: a msgpack map that
  decodes to exactly one :data:`Request` struct (tagged by the ``op`` field). The daemon
  answers each request with one frame decoding to a :data:`Reply` struct (tagged by
  ``r``) carrying the request's ``id``. ``id`` 0 is reserved for unsolicited messages
  from the daemon (:class:`Reclaim`); clients number their requests from 1 and
  demultiplex replies by id.
* **fd channel** — a ``SOCK_SEQPACKET`` Unix socket at ``$RUN_DIR/pages.sock``. On
  accept the daemon sends one :class:`FdHello` (session token, backend, page size);
  afterwards it only sends page descriptors, each message headed by a :class:`FdHeader`.

Reclaim (see DESIGN.md "Arbitration"): when a grant or lease does not fit, the daemon
sends unsolicited :class:`Reclaim` messages (``id`` 0, numbered by ``seq``) to other
tenants: ``mode="reserve"`` asks for mapped-but-unused units only, ``mode="shrink"``
asks the tenant's shrink callback to empty whole units. The tenant answers each with a
:class:`Reclaimed` request once it has released what it could. Grants that have to wait
for reclaim are answered when the pages are free, or with ``NO_MEMORY`` at the deadline.

After a daemon restart a tenant registers again and sends one :class:`Adopt` request
describing every group it still maps; the page descriptors travel first on the fd
channel, *from the client to the daemon*, headed by :class:`FdHeader` with the request
id, in the same unit-major order as a grant's.

Ordering rule for grants: the daemon sends every fd message of a grant on the fd
channel *before* it sends the :class:`Granted` reply on ZeroMQ. When the client reads
``Granted(id, nfds)`` the descriptors are already queued on its fd socket, in the order
of ``units`` x regions (unit-major: unit 0 of region 0, unit 0 of region 1, ...).
Headers name the request id, so descriptors of a grant the client gave up on are
recognised and closed.

Every reply carries ``ok``; failures are :class:`Error` with a stable ``code`` from
:data:`CODES` and a human ``message``. Anything that fails to decode or validate gets an
``Error(BAD_REQUEST)`` (or ``VERSION``) reply; the daemon never raises on input.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta, Struct

VERSION = 2  # 2: arbitration (reclaim, leases, knobs), adopt after a daemon restart, admin ops

# ---- bounds (validated on decode) ------------------------------------------------
MAX_FRAME = 1 << 20  # bytes of one control message
MAX_NAME = 64
MAX_REGIONS = 4096  # regions per group (layers x K/V of the biggest models, with margin)
MAX_PAGES_PER_REGION = 1 << 22  # virtual pages of one region (8 TiB at 2 MiB)
MAX_UNITS = 1 << 16  # units named in one request
MAX_GROUPS = 256  # live groups per tenant
MAX_BYTES = 1 << 50  # any byte count
MAX_ID = (1 << 63) - 1
MAX_GROUP_ID = (1 << 31) - 1  # group ids the daemon hands out (and accepts in an Adopt)
MAP_REPLY_BYTES = 1 << 20  # a map reply stays about this small; the rest is paged
MAP_BASES = 8  # region bases shown per group in a map reply
MAP_GROUPS = 1024  # groups in one map reply, at most

# ---- error codes (stable: clients and scripts match on them) ---------------------
BAD_REQUEST = "BAD_REQUEST"  # undecodable, invalid, or inconsistent with the state
UNAUTHORIZED = "UNAUTHORIZED"  # missing or wrong session token, or not allowed
NOT_FOUND = "NOT_FOUND"  # no such group / tenant (or not yours)
OVER_LIMIT = "OVER_LIMIT"  # the grant would take the tenant past its max
NO_MEMORY = "NO_MEMORY"  # the budget is exhausted
BUSY = "BUSY"  # try again later (e.g. the fd channel is congested)
VERSION_MISMATCH = "VERSION"  # protocol versions differ
INTERNAL = "INTERNAL"  # a daemon bug or a backend failure; the daemon keeps serving
CODES = frozenset(
    {BAD_REQUEST, UNAUTHORIZED, NOT_FOUND, OVER_LIMIT, NO_MEMORY, BUSY, VERSION_MISMATCH, INTERNAL}
)

Id = Annotated[int, Meta(ge=0, le=MAX_ID)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9._@:+-]+$")]
Token = Annotated[str, Meta(max_length=64)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
Unit = Annotated[int, Meta(ge=0, lt=MAX_PAGES_PER_REGION)]
Units = Annotated[list[Unit], Meta(max_length=MAX_UNITS)]
Kind = Annotated[str, Meta(pattern=r"^(engine|lease|monitor|admin|test)$")]
Weight = Annotated[float, Meta(gt=0, le=10000)]
Seq = Annotated[int, Meta(ge=0, le=MAX_ID)]


# ====================================================================== requests
class Request(Struct, tag_field="op", kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every request. ``token`` is the session token (empty for monitor ops)."""

    id: Id = 0
    token: Token = ""


class Register(Request, tag="register"):
    """Bind this ZeroMQ connection to the fd-channel session named by ``token``."""

    name: Name
    kind: Kind = "engine"
    device: Annotated[int, Meta(ge=0, le=1024)] = 0
    version: int = VERSION
    # the tenant's own knobs; used only when the daemon's config has no entry for ``name``
    min: Optional[Bytes] = None
    max: Optional[Bytes] = None
    weight: Optional[Weight] = None


class CreateGroup(Request, tag="create_group"):
    """Register ``n_regions`` equal regions of ``capacity`` bytes each (a multiple of the
    page size) reserved by the client at ``bases`` (informational: shown by ``map``)."""

    n_regions: Annotated[int, Meta(ge=1, le=MAX_REGIONS)]
    capacity: Annotated[int, Meta(ge=1, le=MAX_BYTES)]
    bases: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_ID)]], Meta(max_length=MAX_REGIONS)] = []
    label: Annotated[str, Meta(max_length=MAX_NAME)] = ""


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
    weight: Optional[Weight] = None


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


REQUESTS = (
    Register, CreateGroup, DestroyGroup, Grant, Release, Report, Bye, Ping,
    Ps, Stats, MapReq, SetLimit, Check, Lease, Reclaimed, Adopt, Shutdown, Events,
)
AnyRequest = Union[REQUESTS]  # type: ignore[valid-type]
MONITOR_OPS = frozenset({"ps", "stats", "map", "ping", "check", "events"})
ADMIN_OPS = frozenset({"set_limit", "shutdown"})


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
    kind: str
    pid: int
    uid: int
    registered: bool
    groups: int
    mapped: int  # bytes granted (pages x page size)
    in_use: int  # bytes the client reports in use
    reserve: int  # bytes mapped but idle (client's reserve)
    min: int
    max: int
    weight: float
    lease: int = 0  # bytes leased (held outside kvpool's mappings)
    share: int = 0  # weighted fair share right now (bytes)
    asked: int = 0  # bytes the daemon is waiting for this tenant to give back
    ignored: int = 0  # reclaims this tenant let expire
    unresponsive: bool = False  # capped at its min until it answers a reclaim
    waiting: int = 0  # bytes of this tenant's requests waiting for reclaim
    retained: int = 0  # bytes of pages it released but still references (charged to it)


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
    bases: list[int]  # the first MAP_BASES region bases (informational)
    runs: list[Run] = []  # the page table, run-length encoded (size: O(mapped units))
    pfns: Optional[dict[int, list[int]]] = None  # unit -> pfn per region (on request)

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
    mode: str = "reserve"
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
    """One decision of the daemon. ``kind``: grant, wait, deny, lease, ask, reclaim (a
    whole round: ``detail`` has its asks and answers by tenant), limit, death, bye."""

    seq: int
    time: float  # unix seconds
    kind: str
    tenant: str = ""
    tenant_id: int = 0
    bytes: int = 0
    detail: dict[str, Any] = {}


class EventsReply(Reply, tag="events"):
    """``next``: pass it as ``since`` to go on; ``lost``: events after ``since`` that
    the daemon's ring buffer no longer holds (a gap)."""

    events: list[EventInfo] = []
    next: int = 0
    lost: int = 0


REPLIES = (
    Error, Registered, GroupCreated, Granted, Done, PsReply, StatsReply, MapReply,
    CheckReply, Reclaim, LimitSet, Leased, Adopted, EventsReply,
)
AnyReply = Union[REPLIES]  # type: ignore[valid-type]


# ====================================================================== fd channel
class FdHello(Struct, array_like=True):
    """First message on a new fd-channel connection (no descriptors). A refused session
    (too many sessions) gets an empty ``token`` and the reason in ``error``, then EOF."""

    version: int
    token: str
    backend: str
    device: int
    page_size: int
    error: str = ""


class FdHeader(Struct, array_like=True):
    """Heads each descriptor message of a grant: ``first`` is the index of this
    message's first fd among the grant's ``total``."""

    id: int
    total: int
    first: int


# ====================================================================== codecs
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)
_hello_decoder = msgspec.msgpack.Decoder(FdHello)
_header_decoder = msgspec.msgpack.Decoder(FdHeader)
_loose_decoder = msgspec.msgpack.Decoder()

encode = _encoder.encode


class DecodeError(ValueError):
    """A frame that is not a valid message; ``id`` is the request id when recoverable."""

    def __init__(self, message: str, id: int = 0, code: str = BAD_REQUEST):
        super().__init__(message)
        self.id = id
        self.code = code


def _salvage_id(frame: bytes) -> int:
    """The ``id`` of an invalid request, when the frame is at least a map with an int id."""
    try:
        obj = _loose_decoder.decode(frame)
    except Exception:
        return 0
    if isinstance(obj, dict):
        value = obj.get("id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ID:
            return value
    return 0


def decode_request(frame: bytes) -> Request:
    """Decode and validate one request frame; raises :class:`DecodeError` only."""
    if len(frame) > MAX_FRAME:
        raise DecodeError(f"message of {len(frame)} bytes exceeds {MAX_FRAME}", _salvage_id(frame[:4096]))
    try:
        return _request_decoder.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise DecodeError(f"invalid request: {e}", _salvage_id(frame)) from None
    except Exception as e:  # defensive: msgspec raises only DecodeError, but never crash
        raise DecodeError(f"invalid request: {type(e).__name__}: {e}", 0) from None


def decode_reply(frame: bytes) -> Reply:
    return _reply_decoder.decode(frame)


def decode_hello(data: bytes) -> FdHello:
    return _hello_decoder.decode(data)


def decode_header(data: bytes) -> FdHeader:
    return _header_decoder.decode(data)


def error(id: int, code: str, message: str) -> Error:
    assert code in CODES, code
    return Error(id=id, code=code, message=message)


def to_builtins(obj: Any) -> Any:
    """Plain dicts/lists for JSON output (CLI ``--json``)."""
    return msgspec.to_builtins(obj)
