"""The engine's ``/metrics`` in Prometheus text, with vLLM's metric names where kvpool's
engine has a counterpart (so dashboards and alerts written for vLLM read it as is):

==========================================  =========  ===================================
name                                        type       from
==========================================  =========  ===================================
``vllm:num_requests_running``               gauge      scheduler's running queue
``vllm:num_requests_waiting``               gauge      scheduler's waiting queue
``vllm:kv_cache_usage_perc``                gauge      KV blocks used / (held + grantable
                                                       at once) (0..1; see below)
``vllm:cache_config_info``                  gauge      1, labels ``block_size`` and
                                                       ``num_gpu_blocks`` (held + grantable)
``vllm:prefix_cache_queries_total``         counter    prompt tokens looked up
``vllm:prefix_cache_hits_total``            counter    prompt tokens found cached
``vllm:num_preemptions_total``              counter    preemptions
``vllm:prompt_tokens_total``                counter    prompt tokens
``vllm:generation_tokens_total``            counter    generated tokens
``vllm:request_success_total``              counter    finished requests, by reason
``vllm:time_to_first_token_seconds``        histogram  arrival to first token
``vllm:time_per_output_token_seconds``      histogram  mean time between output tokens
``vllm:e2e_request_latency_seconds``        histogram  arrival to finish
``kvpool_engine_kv_held_bytes``             gauge      KV memory the engine holds
``kvpool_engine_kv_blocks``                 gauge      blocks by state (used, free, cached)
``kvpool_engine_elastic_waits_total``       counter    elastic allocations that waited
                                                       for the daemon's grant
``kvpool_engine_elastic_grants_total``      counter    grants the elastic allocator got
``kvpool_engine_steps_total``               counter    engine steps
``kvpool:asleep``                           gauge      1 while the model sleeps (holds no KV)
``kvpool:kv_blocks_held``                   gauge      usable KV blocks mapped now
``kvpool:kv_blocks_grantable``              gauge      more the daemon would grant at once
``kvpool:headroom_bytes``                   gauge      the daemon's ``Room.headroom`` (elastic)
``kvpool:granted_bytes``                    gauge      what the tenant holds (elastic)
``kvpool:min_bytes``, ``kvpool:max_bytes``  gauge      its knobs (elastic)
``kvpool:pool_free_bytes``                  gauge      the daemon pool's free memory (elastic)
==========================================  =========  ===================================

The router's protocol (docs/KUBERNETES.md, "The model-server protocol"): an endpoint
picker reads ``vllm:kv_cache_usage_perc`` as how close this server is to refusing or
preempting work. With elastic KV there is no fixed total: the server holds what the
daemon granted and may get more at once, so the fraction is blocks in use over blocks
held plus blocks the daemon would grant now (``Room``: no reclaim, no wait), never over
the virtual maximum; ``num_gpu_blocks`` is that same denominator, so ``usage x
num_gpu_blocks`` is the blocks in use. A static pool holds all of its blocks and gets
none (the old meaning). An asleep server holds nothing: usage 0 and ``kvpool:asleep``
1 (a request wakes it). The ``kvpool:`` byte gauges are there when the server's KV is
elastic (:class:`MemorySource` gives them); every value is finite and non-negative.

Everything is read at scrape time under the engine's lock (the step thread's lock, as
``/v1/stats`` does); histograms catch up on the requests finished since the last scrape
(the engine keeps the last 1,000; more between two scrapes are counted in
``kvpool_engine_finished_unobserved_total``). Nothing runs on the step path.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvpool.engine.serving.async_engine import AsyncEngine

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0)


@dataclass(frozen=True)
class MemoryView:
    """The KV memory a server could use now, as its adapter sees it: ``held`` usable
    blocks mapped (in use, cached or free; not the null block), ``grantable`` more
    blocks the daemon would grant at once, ``asleep``, and ``scalars``: the
    ``kvpool:`` gauges by name (bytes)."""

    held: int
    grantable: int
    asleep: bool = False
    scalars: Mapping[str, float] = field(default_factory=dict)


class MemorySource(Protocol):
    """Where an elastic server's :class:`MemoryView` comes from (an adapter's); None
    when it cannot say now (the static meaning is used then). Called at scrape time,
    outside the engine's lock; it must not wait on the daemon."""

    def memory_view(self) -> MemoryView | None: ...


def finite(v: float) -> float:
    """``v``, or 0 when it is NaN, infinite or negative (a gauge a router reads)."""
    return v if math.isfinite(v) and v > 0 else 0.0


def kv_usage(used: int, held: int, grantable: int) -> float:
    """Blocks in use over held plus grantable, within 0..1 (0 with nothing to use)."""
    room = held + grantable
    return min(1.0, finite(used / room)) if room > 0 else 0.0


class EngineMetrics:
    """Prometheus text for one :class:`~kvpool.engine.serving.async_engine.AsyncEngine`
    (with ``memory``: an elastic server's view of its KV memory)."""

    def __init__(self, aengine: AsyncEngine, memory: MemorySource | None = None) -> None:
        self.aengine = aengine
        self.memory = memory
        self.view: MemoryView | None = None  # at the last scrape
        self.model = str(getattr(aengine.engine, "served_model_name", "") or "")
        self.registry = CollectorRegistry(auto_describe=False)
        lab = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              lab, buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token.",
                              lab, buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             lab, buckets=E2E_BUCKETS, registry=self.registry)
        for h in (self.ttft, self.tpot, self.e2e):
            h.labels(self.model)  # exported (at zero) before the first request
        self.registry.register(_Collector(self))
        self._seen = 0  # finished requests observed in the histograms
        self.unobserved = 0
        self.reasons: dict[str, int] = {}
        self.stats: dict[str, Any] = {}  # Engine.stats() at the last scrape
        self.elastic: tuple[int, int] | None = None
        self._render_lock = threading.Lock()

    def render(self) -> bytes:
        with self._render_lock:
            self._catch_up()
            self.view = None
            if self.memory is not None:
                try:  # an adapter's failure leaves the static meaning, never a 500
                    self.view = self.memory.memory_view()
                except Exception as e:
                    log.debug("memory view: %s: %s", type(e).__name__, e)
            return generate_latest(self.registry)

    def _catch_up(self) -> None:
        """Read the engine once, under its lock: stats, new finished requests."""
        a = self.aengine
        with a._lock:
            eng = a.engine
            self.stats = eng.stats()
            done = eng.counters["finished"]
            new = done - self._seen
            finished = list(eng._finished)[-new:] if new > 0 else []
            self._seen = done
            alloc = getattr(getattr(eng, "pool", None), "allocator", None)
            self.elastic = ((int(getattr(alloc, "slow_allocs", 0)), int(getattr(alloc, "grants", 0)))
                            if alloc is not None else None)
        self.unobserved += max(0, new - len(finished))
        for r in finished:
            m = r.metrics
            reason = str(r.finish_reason or "unknown")
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
            if m.ttft is not None:
                self.ttft.labels(self.model).observe(m.ttft)
            n = r.num_output_tokens
            if m.first_token_time is not None and m.finish_time is not None and n >= 2:
                self.tpot.labels(self.model).observe((m.finish_time - m.first_token_time) / (n - 1))
            if m.finish_time is not None:
                self.e2e.labels(self.model).observe(m.finish_time - m.arrival_time)


#: the ``kvpool:`` byte gauges an elastic server's :class:`MemoryView` gives
SCALARS = {
    "kvpool:headroom_bytes": "Bytes the daemon would grant this server at once.",
    "kvpool:granted_bytes": "Bytes this server's tenant holds (its grant).",
    "kvpool:min_bytes": "The tenant's guaranteed minimum, bytes.",
    "kvpool:max_bytes": "The tenant's limit, bytes.",
    "kvpool:pool_free_bytes": "Bytes of the daemon's pool free now.",
}


class _Collector:
    def __init__(self, em: EngineMetrics) -> None:
        self.em = em

    def collect(self) -> Iterator[Metric]:
        em, s = self.em, self.em.stats
        if not s:
            return
        lv = [em.model]

        def gauge(name: str, text: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, text, labels=["model_name"])
            g.add_metric(lv, v)
            return g

        def counter(name: str, text: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, text, labels=["model_name"])
            c.add_metric(lv, v)
            return c

        kv = s["kv_blocks"]
        view = em.view or MemoryView(held=int(kv["total"]), grantable=0)
        yield gauge("vllm:num_requests_running", "Requests running.", s["running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting.", s["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent): "
                    "blocks used over blocks held plus grantable at once.",
                    kv_usage(int(kv["used"]), view.held, view.grantable))
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (blocks "
                                 "held plus grantable at once).",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([em.model, str(kv["block_size"]),
                         str(max(0, view.held) + max(0, view.grantable))], 1)
        yield info
        yield gauge("kvpool:asleep", "1 while the model sleeps (it holds no KV).",
                    1 if view.asleep else 0)
        yield gauge("kvpool:kv_blocks_held", "Usable KV blocks mapped now.",
                    finite(view.held))
        yield gauge("kvpool:kv_blocks_grantable", "More KV blocks the daemon would grant "
                    "at once.", finite(view.grantable))
        for name, v in sorted(view.scalars.items()):
            yield gauge(name, SCALARS.get(name, name), finite(v))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache.", s["prompt_tokens"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s["prefix_hit_tokens"])
        yield counter("vllm:num_preemptions", "Preemptions.", s["preemptions"])
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", s["prompt_tokens"])
        yield counter("vllm:generation_tokens", "Tokens generated.", s["generated_tokens"])
        c = CounterMetricFamily("vllm:request_success", "Finished requests, by reason.",
                                labels=["model_name", "finished_reason"])
        for reason, n in sorted(em.reasons.items()):
            c.add_metric([em.model, reason], n)
        yield c
        yield gauge("kvpool_engine_kv_held_bytes", "KV memory the engine holds.",
                    s["kv_held_bytes"])
        g = GaugeMetricFamily("kvpool_engine_kv_blocks", "KV blocks by state.",
                              labels=["model_name", "state"])
        for state in ("used", "free", "cached"):
            g.add_metric([em.model, state], kv[state])
        yield g
        yield counter("kvpool_engine_steps", "Engine steps.", s["steps"])
        yield counter("kvpool_engine_finished_unobserved", "Finished requests the latency "
                      "histograms missed (more than 1,000 between two scrapes).", em.unobserved)
        if em.elastic is not None:
            yield counter("kvpool_engine_elastic_waits", "Elastic allocations that waited "
                          "for the daemon's grant.", em.elastic[0])
            yield counter("kvpool_engine_elastic_grants", "Grants the elastic allocator got "
                          "from the daemon.", em.elastic[1])
