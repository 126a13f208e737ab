"""The step-thread commands of :class:`~.warm_engine.RetiringEngine` (put on its inbox by
the HTTP handlers), and what it keeps for an adopted request nobody follows yet."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvpool.engine.request import RequestOutput


@dataclass
class Retire:
    """``/pd/retire``: hand over to tenant ``to``; the answer goes to ``out``."""

    to: str
    ttl_s: float
    in_flight: bool
    url: str | None  # the new server, for the relays
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]


@dataclass
class Attach:
    """``/pd/follow/{id}``: a follower for an adopted request."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]


@dataclass
class Drop:
    """``DELETE /pd/follow/{id}``: an adopted request nobody will follow (its client
    left the old server); only such a request can be dropped this way."""

    request_id: str


@dataclass
class Follow:
    """An adopted request nobody follows yet: aborted at ``deadline``."""

    deadline: float
    latest: RequestOutput | None = None  # cumulative: the latest is all there is to send
