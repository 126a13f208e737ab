"""The fleet's own endpoint in a cluster router's model-server protocol (docs/KUBERNETES.md,
"The model-server protocol"): the names a router reads from ``GET /metrics``, one
series per model (``model_name``), beside the fleet's own metrics.

* ``vllm:num_requests_waiting``: requests in the fleet's queue for the model (waiting
  for a ready replica);
* ``vllm:num_requests_running``: requests the fleet sent its replicas, not finished;
* ``vllm:kv_cache_usage_perc``: how close the model is to refusing or preempting work
  *through this endpoint*: the fleet sends a request to its least loaded replica, so
  the least KV use among its awake replicas (each: blocks used over blocks held plus
  blocks the daemon would grant it at once, as the server says); 0 when none is awake
  (an asleep or stopped replica holds nothing and is woken or started for a request);
* ``vllm:cache_config_info{block_size, num_gpu_blocks}``: 1; the awake replicas' held
  blocks plus the most any one of them could be granted at once (the pool's room is
  shared: counted once);
* ``kvpool:asleep``: 1 when no replica is awake and one is asleep;
* ``kvpool:pool_free_bytes``, ``kvpool:granted_bytes``: the pool's free memory and the
  model's replicas' grants together, as their servers last said.

A replica's numbers are what the supervisor's watch last read from its server's
``/v1/stats`` (:func:`member_kv`, every ``poll_s``; vLLM replicas have none, and count
as awake replicas of unknown use: they are left out of the minimum). Every value is
finite and non-negative.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

MAX_COUNT = 1 << 50  # a count or byte figure a server reports, at most


@dataclass(frozen=True)
class MemberKV:
    """One replica's KV as its server last said (blocks; bytes for the pool figures)."""

    used: int
    held: int
    grantable: int
    block_size: int
    asleep: bool = False
    pool_free: int = 0
    granted: int = 0

    @property
    def usage(self) -> float:
        room = self.held + self.grantable
        return min(1.0, self.used / room) if room > 0 else 0.0


def _count(body: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = body.get(key, default)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
        raise ValueError(f"{key}: expected a count in 0..{MAX_COUNT}, got {str(v)[:40]!r}")
    return v


def member_kv(body: Any) -> MemberKV:
    """A server's ``/v1/stats`` body read as :class:`MemberKV`; ValueError (one line) for
    a body that is not one (a server's answer is checked like any input). Without
    ``kv_room`` (a static server) it holds all of its blocks and gets none."""
    if not isinstance(body, dict) or not isinstance(body.get("kv_blocks"), dict):
        raise ValueError(f"unexpected stats {str(body)[:80]!r}")
    kv = body["kv_blocks"]
    used, block_size = _count(kv, "used"), _count(kv, "block_size")
    room = body.get("kv_room")
    if room is None:
        return MemberKV(used, _count(kv, "total"), 0, block_size)
    if not isinstance(room, dict) or not isinstance(room.get("asleep", False), bool):
        raise ValueError(f"unexpected kv_room {str(room)[:80]!r}")
    return MemberKV(used, _count(room, "held"), _count(room, "grantable"), block_size,
                    bool(room.get("asleep", False)),
                    _count(room, "kvpool:pool_free_bytes", 0),
                    _count(room, "kvpool:granted_bytes", 0))


class Replica(Protocol):
    """What is read of a replica (a :class:`~kvpool.fleet.member.Member`)."""

    @property
    def state(self) -> str: ...

    @property
    def kv(self) -> MemberKV | None: ...

    @property
    def inflight(self) -> int: ...


class Queue(Protocol):
    """What is read of a model's queue (a :class:`~kvpool.fleet.admission.ModelQueue`)."""

    @property
    def members(self) -> Sequence[Replica]: ...

    @property
    def waiting(self) -> int: ...


class FleetProtocol:
    """The collector of the names above over ``queues`` (registered in the fleet's
    metrics registry; read at scrape time on the event loop's thread)."""

    def __init__(self, queues: Mapping[str, Queue]) -> None:
        self.queues = queues

    def collect(self) -> Iterator[Metric]:
        fams = {
            "waiting": GaugeMetricFamily("vllm:num_requests_waiting", "Requests in the "
                                         "fleet's queue.", labels=["model_name"]),
            "running": GaugeMetricFamily("vllm:num_requests_running", "Requests the fleet's "
                                         "replicas are serving.", labels=["model_name"]),
            "usage": GaugeMetricFamily("vllm:kv_cache_usage_perc", "The least KV use among "
                                       "the awake replicas (0..1).", labels=["model_name"]),
            "info": GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                      labels=["model_name", "block_size", "num_gpu_blocks"]),
            "asleep": GaugeMetricFamily("kvpool:asleep", "1 when no replica is awake and "
                                        "one is asleep.", labels=["model_name"]),
            "free": GaugeMetricFamily("kvpool:pool_free_bytes", "The daemon pool's free "
                                      "bytes.", labels=["model_name"]),
            "granted": GaugeMetricFamily("kvpool:granted_bytes", "The replicas' grants "
                                         "together, bytes.", labels=["model_name"]),
        }
        for name, q in self.queues.items():
            awake = [m for m in q.members if m.state == "awake"]
            seen = [m.kv for m in awake if m.kv is not None]
            known = [m.kv for m in q.members if m.kv is not None
                     and m.state in ("awake", "asleep")]
            fams["waiting"].add_metric([name], max(0, q.waiting))
            fams["running"].add_metric([name], sum(max(0, m.inflight) for m in q.members))
            fams["usage"].add_metric([name], min((k.usage for k in seen), default=0.0))
            blocks = sum(k.held for k in seen) + max((k.grantable for k in seen), default=0)
            size = next((k.block_size for k in known), 0)
            fams["info"].add_metric([name, str(size), str(blocks)], 1)
            fams["asleep"].add_metric([name], 1 if not awake and any(
                m.state == "asleep" for m in q.members) else 0)
            fams["free"].add_metric([name], max((k.pool_free for k in known), default=0))
            fams["granted"].add_metric([name], sum(k.granted for k in known))
        yield from fams.values()
