"""The gang tests' harness: rank processes from the zygote (``gang_ranks.py``), gangs of
them, collective calls, and the invariants checked from the daemon's views."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvpool import protocol as p

ZYGOTE = Path(__file__).with_name("gang_ranks.py")
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # generous: a loaded machine (no test waits on time to synchronise)


@dataclass
class Rank:
    rank: int
    pid: int
    conn: socket.socket
    file: object
    token: str = ""

    def send(self, cmd: dict) -> None:
        self.file.write(json.dumps(cmd) + "\n")  # type: ignore[attr-defined]
        self.file.flush()  # type: ignore[attr-defined]

    def read(self) -> dict:
        line = self.file.readline()  # type: ignore[attr-defined]
        if not line:
            raise EOFError(f"rank {self.rank} (pid {self.pid}) closed its connection")
        return json.loads(line)

    def call(self, cmd: dict) -> dict:
        self.send(cmd)
        return self.read()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        try:
            self.call({"op": "close"})
        except (OSError, EOFError, ValueError):
            pass
        self.conn.close()


@dataclass
class GangProcs:
    name: str
    ranks: list[Rank]
    gang_id: int = 0
    mapped: set[int] = field(default_factory=set)  # what every rank maps (the harness's view)

    def collective(self, cmd: dict) -> list[dict]:
        """Send ``cmd`` to every rank first, then read every answer."""
        for r in self.ranks:
            r.send(cmd)
        return [r.read() for r in self.ranks]


class Ranks:
    """Forks rank processes through one zygote; each connects back on a Unix socket."""

    def __init__(self, run_dir: Path, tmp: Path):
        self.run_dir = run_dir
        self.path = str(tmp / "ranks.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.listener.settimeout(WAIT_S)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.zygote = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)

    def spawn(self, **spec: object) -> Rank:
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        spec = dict(spec, sock=self.path, run_dir=str(self.run_dir))
        self.zygote.stdin.write(json.dumps(spec) + "\n")
        self.zygote.stdin.flush()
        pid = int(self.zygote.stdout.readline())
        conn, _ = self.listener.accept()
        conn.settimeout(WAIT_S)
        f = conn.makefile("rw", buffering=1)
        r = Rank(int(spec["rank"]), pid, conn, f)  # type: ignore[call-overload]
        hello = r.read()
        if "error" in hello:
            conn.close()
            raise RuntimeError(f"rank {spec['rank']}: {hello['error']}")
        r.token = hello.get("token") or ""
        return r

    def gang(self, name: str, devices: list[int], layout: list[tuple[int, int]]) -> GangProcs:
        r0 = self.spawn(rank=0, name=name, devices=devices, layout=layout)
        ranks = [r0] + [self.spawn(rank=i, name=name, devices=devices, layout=layout,
                                   token=r0.token) for i in range(1, len(devices))]
        return GangProcs(name, ranks)

    def close(self) -> None:
        if self.zygote.stdin is not None:
            self.zygote.stdin.close()
        self.zygote.wait(WAIT_S)
        if self.zygote.stdout is not None:
            self.zygote.stdout.close()
        self.listener.close()


def gang_tables(monitors: dict, views: dict | None = None) -> dict[int, dict[int, set[int]]]:
    """From every device's ``ps`` and ``map`` (``views``: device -> (ps, map) replies
    already read): gang id -> rank -> the units its (one) group holds."""
    out: dict[int, dict[int, set[int]]] = {}
    for dev, mon in monitors.items():
        ps, mp = views[dev] if views else (mon.ps(), mon.map())
        ranks = {t.id: (t.gang, t.rank) for t in ps.tenants if t.gang}
        for g in mp.groups:
            if g.tenant in ranks:
                gang, rank = ranks[g.tenant]
                units = {r.start + i for r in g.runs for i in range(r.length)}
                out.setdefault(gang, {})[rank] = units
    return out


SNAPSHOT_TRIES = 50  # reads of every device until two in a row agree


def _snapshot(monitors: dict) -> dict:
    """device -> (ps, map), read device after device."""
    return {dev: (mon.ps(), mon.map()) for dev, mon in monitors.items()}


def _same(a: dict, b: dict) -> bool:
    """Two snapshots show the same pools and the same gang tables (no page moved)."""
    pools = all((a[d][0].pool.granted, a[d][0].pool.leased, a[d][0].pool.retained)
                == (b[d][0].pool.granted, b[d][0].pool.leased, b[d][0].pool.retained)
                for d in a)
    return pools and gang_tables(a, a) == gang_tables(b, b)


def consistent_views(monitors: dict) -> dict:
    """Every device's views as of one moment. Devices are read one after another, so a
    gang's collective move (a reclaim ask it answers on its own thread: every rank's
    pages go back in one daemon step) can fall between two devices' reads and show a
    split that never existed; two full reads in a row that agree saw no move between
    them (only the test's own thread grants, and it waits here)."""
    views = _snapshot(monitors)
    for _ in range(SNAPSHOT_TRIES):
        again = _snapshot(monitors)
        if _same(views, again):
            return again
        views = again
    raise AssertionError(f"pages kept moving over {SNAPSHOT_TRIES} reads of every device")


def invariant_problems(monitors: dict, size: int) -> list[str]:
    """Every device's self-check, its budget, and no gang (of ``size`` ranks)
    half-granted, as the views show it (one consistent reading of every device),
    independently of the daemon's own check."""
    problems: list[str] = []
    for dev, mon in monitors.items():
        problems += [f"device {dev}: {x}" for x in mon.check()]
    views = consistent_views(monitors)
    for dev in monitors:
        pool = views[dev][0].pool
        assert pool is not None and pool.device == dev
        if pool.granted + pool.leased + pool.retained > pool.budget:
            problems.append(f"device {dev} over its budget: {pool}")
    for gang, tables in gang_tables(monitors, views).items():
        held = {r: u for r, u in tables.items() if u}
        if held and (len(tables) != size or
                     len({frozenset(u) for u in tables.values()}) != 1):
            problems.append(f"gang {gang} half-granted: " + ", ".join(
                f"rank {r}: {sorted(u)}" for r, u in sorted(tables.items())))
    return problems


def error_code(reply: p.Reply) -> str:
    return reply.code if isinstance(reply, p.Error) else ""
