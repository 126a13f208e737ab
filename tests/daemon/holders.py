"""Many tenants in one process, for the scale tests: ``holders.py RUN_DIR PREFIX TENANTS
GROUPS PAGES`` opens TENANTS sessions named PREFIX0.., GROUPS one-region groups spread
over them round robin, grants PAGES pages spread evenly over the groups (batches of 64
units), prints ``{"event": "ready", "pid": ..., "per_tenant": {name: bytes}}`` and sleeps
until killed."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    run_dir, prefix = sys.argv[1], sys.argv[2]
    tenants, groups, pages = (int(x) for x in sys.argv[3:6])
    from kvpool.client_lib import Tenant

    ts = [Tenant(f"{prefix}{i}", run_dir=run_dir, keeper=False) for i in range(tenants)]
    per = [pages // groups + (k < pages % groups) for k in range(groups)]
    held: dict[str, int] = {t.name: 0 for t in ts}
    for k in range(groups):
        t = ts[k % tenants]
        g = t.region_group(1, max(1, per[k]) * t.page_size)
        for first in range(0, per[k], 64):
            g.grant(range(first, min(per[k], first + 64)))
        held[t.name] += per[k] * t.page_size
    print(json.dumps({"event": "ready", "pid": os.getpid(), "per_tenant": held}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
