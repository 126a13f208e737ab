"""Head-of-line blocking: an honest tenant's grant latency while another tenant's grant
waits for reclaim from a tenant that never answers (issue 9 #11; host backend).

A silent tenant holds most of the budget and never answers a reclaim; the honest tenant
(the client library, fair share to spare) releases one unit and grants it again in a
loop, timing each grant. Phases are interleaved, ``--reps`` times: ``baseline`` (nobody
waiting) and ``waiter`` (a third tenant's grant queued for reclaim, deadline 60 s, so it
waits through the whole phase). Before the fix each honest grant of the ``waiter``
phase waited behind the queued grant until its reclaim deadline (~2 s by default).

    .venv/bin/python benchmarks/hol_bench.py [--reps 3] [--seconds 2]

Writes benchmarks/results/hol_bench.json.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grant_phases import against_baseline, arguments, report, time_grants  # noqa: E402

from kvpool import protocol as p  # noqa: E402

PAGE = 64 << 10
BUDGET = 64  # pages
SILENT = 56  # pages the silent tenant holds (above its fair share): the budget is full
HONEST = 8
ASK = 8  # the waiter's grant: does not fit until reclaim frees pages


def waiting(mon) -> int:
    return sum(t.waiting for t in mon.stats().tenants)


def run(args) -> dict:
    from kvpool.client_lib import Monitor, connect
    from kvpool.client_lib.connection import Connection
    from kvpool.demo.cluster import Cluster

    samples: dict[str, list[int]] = {"baseline": [], "waiter": []}
    with tempfile.TemporaryDirectory(prefix="kvpbench-") as tmp, Cluster(Path(tmp)) as cluster:
        cluster.daemon(BUDGET * PAGE, PAGE, extra=("--log-level", "WARNING", "--warm-max", "0",
                                                   "--reclaim-timeout", "60"))
        run_dir = cluster.run_dir
        silent = Connection(run_dir, timeout_s=30)  # raw: reads no reclaim, answers none
        silent.call(p.Register(name="silent"))
        gs = silent.call(p.CreateGroup(n_regions=1, capacity=SILENT * PAGE))[0].group
        for fd in silent.call(p.Grant(group=gs, units=list(range(SILENT))))[1]:
            os.close(fd)
        with connect(name="honest", run_dir=run_dir, timeout_s=60) as t, Monitor(run_dir) as mon:
            g = t.region_group(1, HONEST * PAGE)
            g.grant(list(range(HONEST)))  # the budget is full now
            time_grants(g, 0.3, held=True)  # warm up
            for _ in range(args.reps):
                for phase in ("waiter", "baseline"):
                    waiter = None
                    if phase == "waiter":
                        waiter = Connection(run_dir, timeout_s=30)
                        waiter.call(p.Register(name="waiter"))
                        gw = waiter.call(p.CreateGroup(n_regions=1, capacity=ASK * PAGE))[0].group
                        req = p.Grant(id=999, token=waiter.token, group=gw, units=list(range(ASK)))
                        waiter.sock.send(p.encode(req))  # queued; nobody reads its answer
                        deadline = time.monotonic() + 10
                        while not waiting(mon) and time.monotonic() < deadline:
                            time.sleep(0.01)
                        assert waiting(mon), "the waiter's grant never queued"
                    samples[phase] += time_grants(g, args.seconds, held=True)
                    if waiter is not None:
                        assert waiting(mon), "the waiter stopped waiting during the phase"
                        waiter.close()  # its session ends: the queued grant goes with it
                        deadline = time.monotonic() + 10
                        while waiting(mon) and time.monotonic() < deadline:
                            time.sleep(0.01)
            assert mon.check() == []
        silent.close()
        cluster.check_alive()
    return against_baseline(samples)


def main() -> None:
    args = arguments(__doc__, seconds=2.0).parse_args()
    report("hol_bench", run(args), args, PAGE, BUDGET, width=10)


if __name__ == "__main__":
    main()
