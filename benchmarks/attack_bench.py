"""Honest grant latency while one peer attacks the daemon's event loop (host backend).

An honest tenant grants and releases one page in a loop and times each grant; an
attacker process runs one attack at a time next to it. Phases are interleaved (each
attack, then the baseline with an idle attacker process, repeated ``--reps`` times) and
each attack's p50/p99 is reported as a ratio to the baseline measured in the same run.

Attacks (each loops until stopped):
  adopt_unregistered  Adopts announcing descriptors, from sessions that never registered
  adopt_missing       8 registered sessions whose Adopts announce 5 fds and send none
  nonreader           a session pipelining 300 grants and never reading its fd channel
                      (dropped once its socket stays full; it reconnects and goes again)
  frames              control messages of 100,000 frames each
  conn_flood          200 fd-channel connections opened and closed at a time

    .venv/bin/python benchmarks/attack_bench.py [--reps 3] [--seconds 3]

Writes benchmarks/results/attack_bench.json.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grant_phases import against_baseline, arguments, report, time_grants  # noqa: E402

from kvpool import fdchannel, paths  # noqa: E402
from kvpool import protocol as p  # noqa: E402
from kvpool import launch  # noqa: E402
from tests.daemon.rawpeer import RawPeer  # noqa: E402

PAGE = 64 << 10
BUDGET_PAGES = 4096
ATTACKS = ["adopt_unregistered", "adopt_missing", "nonreader", "frames", "conn_flood"]


# ---- the attacker process (a raw peer: tests/daemon/rawpeer.py) ---------------------
def attack(kind: str, run_dir: Path) -> None:
    """Run one attack until SIGTERM."""
    import zmq

    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    n = itertools.count()
    while not stop:
        if kind == "idle":
            time.sleep(0.05)
        elif kind == "adopt_unregistered":
            peers = [RawPeer(run_dir) for _ in range(8)]
            for peer in peers:
                peer.send(p.Adopt(nfds=7))
                peer.sock.poll(5000)  # its refusal, or 5 s
            for peer in peers:
                peer.close()
        elif kind == "adopt_missing":
            peers = [RawPeer(run_dir) for _ in range(8)]
            for peer in peers:
                peer.call(p.Register(name=f"adopter{next(n)}"))
            for peer in peers:
                peer.send(p.Adopt(nfds=5))
            for peer in peers:
                peer.sock.poll(5000)
                peer.close()
        elif kind == "nonreader":
            peer = RawPeer(run_dir)
            peer.register(f"sink{next(n)}")
            gid = peer.group(300, PAGE)
            for u in range(300):
                peer.send(p.Grant(group=gid, units=[u]))
            deadline = time.monotonic() + 3  # past send_timeout_s: the daemon drops it
            while not stop and time.monotonic() < deadline:
                time.sleep(0.05)
            peer.close()
        elif kind == "frames":
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(paths.control_endpoint(run_dir))
            sock.send_multipart([b"x"] * 100_000)
            sock.poll(30_000)
            sock.close(linger=0)
        elif kind == "conn_flood":
            conns = [fdchannel.connect(str(paths.pages_path(run_dir))) for _ in range(200)]
            for c in conns:
                c.close()


# ---- the honest tenant ------------------------------------------------------------------
def run(args) -> dict:
    from kvpool.client_lib import connect
    from kvpool.demo.cluster import Cluster

    attacks = [a for a in args.attacks.split(",") if a]
    samples: dict[str, list[int]] = {k: [] for k in ["baseline", *attacks]}
    with tempfile.TemporaryDirectory(prefix="kvpbench-") as tmp, Cluster(Path(tmp)) as cluster:
        cluster.daemon(BUDGET_PAGES * PAGE, PAGE, extra=("--log-level", "WARNING"))
        run_dir = cluster.run_dir
        with connect(name="honest", run_dir=run_dir, timeout_s=60) as t:
            g = t.region_group(1, 4 * PAGE)
            time_grants(g, 0.5)  # warm up
            for _ in range(args.reps):
                for kind in [*attacks, "idle"]:
                    proc = subprocess.Popen([sys.executable, __file__, "--attacker", kind,
                                             "--run-dir", str(run_dir)])
                    time.sleep(0.5)  # the attack is under way
                    samples["baseline" if kind == "idle" else kind] += time_grants(
                        g, args.seconds)
                    launch.stop(proc, grace_s=30)  # SIGTERM ends the attack; SIGKILL after 30 s
            cluster.check_alive()
    return against_baseline(samples)


def main() -> None:
    ap = arguments(__doc__, seconds=3.0)
    ap.add_argument("--attacker", choices=["idle", *ATTACKS], help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset")
    args = ap.parse_args()
    if args.attacker:
        attack(args.attacker, args.run_dir)
        return
    results = run(args)
    report("attack_bench", results, args, PAGE, BUDGET_PAGES, width=20)


if __name__ == "__main__":
    main()
