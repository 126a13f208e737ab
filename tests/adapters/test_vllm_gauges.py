"""The gauges a vLLM server's API server adds to vLLM's /metrics (vllm/gauges.py): the
tenant picked from the daemon's ``stats`` by name, the pool's free memory as the daemon
counts it, nothing when the tenant is not there (the live server: test_vllm_kv_events)."""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.engine_adapters.vllm.gauges import KvpoolGauges, TenantView, view_of

MB = 1 << 20


def stats(*tenants: p.TenantInfo, granted: int = 3 * MB, leased: int = MB,
          retained: int = 0) -> p.StatsReply:
    pool = p.PoolInfo(backend="host", device=0, page_size=65536, budget=8 * MB,
                      granted=granted, warm=0, dirty=0, free=0, created=0, warm_min=0,
                      warm_max=0, leased=leased, retained=retained)
    return p.StatsReply(pool=pool, tenants=list(tenants), uptime_s=1.0, requests=1, errors=0)


def tenant(name: str, kind: str = "engine", registered: bool = True, **kw) -> p.TenantInfo:
    base = dict(id=1, name=name, kind=kind, pid=1, uid=0, registered=registered, groups=1,
                mapped=2 * MB, in_use=MB, reserve=MB, min=MB, max=6 * MB, shares=1.0)
    base.update(kw)
    return p.TenantInfo(**base)


def test_the_tenant_by_name_and_the_pool_as_the_daemon_counts_it() -> None:
    s = stats(tenant("other", mapped=MB), tenant("m", lease=MB // 2, state="asleep"),
              tenant("m", kind="lease"), retained=MB)
    assert view_of("m", s) == TenantView(asleep=True, granted=2 * MB + MB // 2, min=MB,
                                         max=6 * MB, pool_free=8 * MB - 3 * MB - MB - MB)
    assert view_of("nobody", s) is None
    assert view_of("m", stats(tenant("m", registered=False))) is None
    assert view_of("m", stats(tenant("m"), granted=8 * MB, leased=MB)).pool_free == 0


class Watch:
    def __init__(self, view: TenantView | None) -> None:
        self.view = view

    def latest(self) -> TenantView | None:
        return self.view


def test_the_collector_says_nothing_without_a_view_or_a_name() -> None:
    view = TenantView(asleep=False, granted=MB, min=0, max=0, pool_free=2 * MB)
    assert list(KvpoolGauges(Watch(None), lambda: "m").collect()) == []  # type: ignore[arg-type]
    assert list(KvpoolGauges(Watch(view), lambda: None).collect()) == []  # type: ignore[arg-type]
    got = {m.name: (m.samples[0].labels, m.samples[0].value)
           for m in KvpoolGauges(Watch(view), lambda: "m").collect()}  # type: ignore[arg-type]
    assert got == {"kvpool:asleep": ({"model_name": "m"}, 0.0),
                   "kvpool:granted_bytes": ({"model_name": "m"}, float(MB)),
                   "kvpool:min_bytes": ({"model_name": "m"}, 0.0),
                   "kvpool:max_bytes": ({"model_name": "m"}, 0.0),
                   "kvpool:pool_free_bytes": ({"model_name": "m"}, float(2 * MB))}
