"""Wire constants: the protocol version, the bounds every message is validated
against on decode, the stable error codes, and the constrained field types."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

VERSION = 3  # 2: arbitration (reclaim, leases, knobs), adopt after a daemon restart, admin ops;
#             3: the fair-share knob is ``shares`` (was ``weight``), ps's ``fair_share``
#             (was ``share``)

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
MAX_RANKS = 64  # ranks of one gang (tensor-parallel degree)
MAX_GANG_GROUPS = 64  # groups in one gang's layout
MAX_DEVICE = 1024  # device ordinals a message may name
MAX_SHARES = 10000.0  # a tenant's fair-share knob, at most (above 0)

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
# units a client grants and releases together (its allocator's chunk)
ChunkUnits = Annotated[int, Meta(ge=1, le=MAX_PAGES_PER_REGION)]
# a session's kind (Register.kind): a KV engine, a lease, a trainer (client_lib/trainer.py),
# a monitor or admin session
# (hold no memory), a test client
Kind = Literal["engine", "lease", "trainer", "monitor", "admin", "test"]
# the metrics dialect a server speaks (a router's engine type: Register.engine)
EngineType = Literal["vllm", "kvpool"]
# a tenant's fair share of contended memory: a proportional count (like cgroup cpu.shares)
Shares = Annotated[float, Meta(gt=0, le=MAX_SHARES)]
Seq = Annotated[int, Meta(ge=0, le=MAX_ID)]
# a gang token: 128 random bits, 32 lowercase hex digits (a capability: never shown)
GangToken = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
Device = Annotated[int, Meta(ge=0, le=MAX_DEVICE)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_RANKS)]
