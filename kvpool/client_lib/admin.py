"""A monitor/admin connection: read-only ops need no tenant session (used by the CLI)."""

from __future__ import annotations

import os
from pathlib import Path

from kvpool import paths
from kvpool import protocol as p
from kvpool.client_lib.connection import Connection


class Monitor:
    def __init__(self, run_dir: str | os.PathLike | None = None, timeout_s: float = 5.0):
        self.run_dir = paths.run_dir(run_dir)
        self.conn = Connection(Path(self.run_dir), timeout_s=timeout_s, fd_channel=False)

    def call(self, req: p.Request) -> p.Reply:
        return self.conn.call(req)[0]

    def ps(self) -> p.PsReply:
        return self.call(p.Ps())  # type: ignore[return-value]

    def stats(self) -> p.StatsReply:
        return self.call(p.Stats())  # type: ignore[return-value]

    def map(self, tenant: str | None = None, pfns: bool = False) -> p.MapReply:
        return self.call(p.MapReq(tenant=tenant, pfns=pfns))  # type: ignore[return-value]

    def set_limit(self, tenant: str, nbytes: int) -> None:
        self.call(p.SetLimit(tenant=tenant, max=nbytes))

    def check(self) -> list[str]:
        return self.call(p.Check()).problems  # type: ignore[attr-defined]

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
