"""The kvpool wire protocol: every control message as a typed msgspec schema.

Transport (see docs/ARCHITECTURE.md, "Wire"):

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

Reclaim (see docs/ARCHITECTURE.md, "Arbitration"): when a grant or lease does not fit, the daemon
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

Layout: :mod:`~kvpool.protocol.bounds` (version, bounds, error codes),
:mod:`~kvpool.protocol.requests` (what clients send), :mod:`~kvpool.protocol.replies`
(what the daemon answers, and the view structs), :mod:`~kvpool.protocol.fd` (fd-channel
messages), :mod:`~kvpool.protocol.endpoint` (the endpoints tenants may register), :mod:`~kvpool.protocol.codec` (encode/decode). Every name is re-exported
here: use ``from kvpool import protocol as p`` and ``p.Grant``, ``p.encode`` ...
A new request type is defined in ``requests.py`` (its reply in ``replies.py``) and
handled through the dispatch table in ``kvpool/daemon/arbiter.py``.
"""

from __future__ import annotations

from kvpool.protocol.bounds import (
    VERSION, MAX_FRAME, MAX_NAME, MAX_REGIONS, MAX_PAGES_PER_REGION, MAX_UNITS,
    MAX_GROUPS, MAX_BYTES, MAX_ID, MAX_GROUP_ID, MAP_REPLY_BYTES, MAP_BASES, MAP_GROUPS,
    BAD_REQUEST, UNAUTHORIZED, NOT_FOUND, OVER_LIMIT, NO_MEMORY, BUSY, VERSION_MISMATCH,
    INTERNAL, CODES, Id, Name, Token, Bytes, Unit, Units, Kind, EngineType, Shares, Seq,
    MAX_RANKS, MAX_GANG_GROUPS, MAX_DEVICE, MAX_SHARES, GangToken, Device, Rank,
)
from kvpool.protocol.requests import (
    Request, Register, CreateGroup, DestroyGroup, Grant, Release, Report, Lease,
    Reclaimed, AdoptGroup, Adopt, Bye, Ping, Ps, Stats, MapReq, SetLimit, Shutdown,
    Check, EVENTS_LIMIT, Events, REQUESTS, AnyRequest, MONITOR_OPS, ADMIN_OPS,
    TicketId, MAX_TTL_MS, Offer, Claim, Cancel, Locate, WeightKey, WeightCreate,
    WeightSeal, WeightAttach, WeightDetach, WeightWrite, WeightPublish, WeightUse,
    SLEEP_REASONS, SLEEP_STATES, SleepTenant, TenantState,
    SESSION_OPS, GangGroup, Layout, CreateGang, SaidState, SleepReason, Room,
)
from kvpool.protocol.replies import (
    Reply, Error, Registered, GroupCreated, Granted, Done, TenantInfo, PoolInfo, Run,
    GroupInfo, PsReply, StatsReply, MapReply, CheckReply, Reclaim, LimitSet, Leased,
    Adopted, EventInfo, EventsReply, REPLIES, AnyReply, SETTLED_STATES, Offered, Claimed,
    Settled, Located, WeightGranted, WeightVersion, SleepAsked, SleepAsk, GangCreated, GangEnded,
    SessionKind, ShownState, ReclaimMode, WeightSetState, SettledState, RoomReply,
)
from kvpool.protocol.endpoint import MAX_ENDPOINT, Endpoint
from kvpool.protocol.fd import (
    FdHello, FdHeader,
)
from kvpool.protocol.codec import (
    encode, DecodeError, decode_request, decode_reply, decode_hello, decode_header,
    error, to_builtins,
)

__all__ = [
    "VERSION", "MAX_FRAME", "MAX_NAME", "MAX_REGIONS", "MAX_PAGES_PER_REGION",
    "MAX_UNITS", "MAX_GROUPS", "MAX_BYTES", "MAX_ID", "MAX_GROUP_ID", "MAP_REPLY_BYTES",
    "MAP_BASES", "MAP_GROUPS", "BAD_REQUEST", "UNAUTHORIZED", "NOT_FOUND", "OVER_LIMIT",
    "NO_MEMORY", "BUSY", "VERSION_MISMATCH", "INTERNAL", "CODES", "Id", "Name", "Token",
    "Bytes", "Unit", "Units", "Kind", "EngineType", "Shares", "Seq", "Request", "Register",
    "CreateGroup", "DestroyGroup", "Grant", "Release", "Report", "Lease", "Reclaimed",
    "AdoptGroup", "Adopt", "Bye", "Ping", "Ps", "Stats", "MapReq", "SetLimit",
    "Shutdown", "Check", "EVENTS_LIMIT", "Events", "REQUESTS", "AnyRequest",
    "MONITOR_OPS", "ADMIN_OPS", "Reply", "Error", "Registered", "GroupCreated",
    "Granted", "Done", "TenantInfo", "PoolInfo", "Run", "GroupInfo", "PsReply",
    "StatsReply", "MapReply", "CheckReply", "Reclaim", "LimitSet", "Leased", "Adopted",
    "EventInfo", "EventsReply", "REPLIES", "AnyReply", "FdHello", "FdHeader", "encode",
    "DecodeError", "decode_request", "decode_reply", "decode_hello", "decode_header",
    "error", "to_builtins", "TicketId", "MAX_TTL_MS", "Offer", "Claim", "Cancel",
    "SETTLED_STATES", "Offered", "Claimed", "Settled", "Locate", "Located",
    "MAX_ENDPOINT", "Endpoint", "WeightKey", "WeightCreate", "WeightSeal",
    "WeightAttach", "WeightDetach", "WeightGranted", "WeightWrite", "WeightPublish",
    "WeightUse", "WeightVersion", "SLEEP_REASONS", "SLEEP_STATES", "SleepTenant",
    "TenantState", "SESSION_OPS", "SleepAsked", "SleepAsk", "MAX_RANKS",
    "MAX_GANG_GROUPS", "MAX_DEVICE", "MAX_SHARES", "GangToken", "Device", "Rank",
    "GangGroup", "Layout", "CreateGang", "GangCreated", "GangEnded", "SaidState",
    "SleepReason", "SessionKind", "ShownState", "ReclaimMode", "WeightSetState",
    "SettledState", "Room", "RoomReply",
]
