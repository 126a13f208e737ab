"""A writer process for the mutable weight-set tests: creates mutable set KEY of NBYTES
per buffer (``--kind`` its session's kind), fills both buffers with byte 1, seals
(version 1) and prints ``{"event": "ready"}``. Then, per stdin line: ``write B`` opens
the back buffer, fills its first half with byte ``B`` and prints ``{"event": "writing"}``
(a test kills it there: mid-publish); ``finish B`` fills the rest and publishes
(``{"event": "published", "version": V}``); EOF ends it."""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

from kvpool.client_lib import connect
from kvpool.client_lib.mutable_weights import MutableWriter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("key")
    ap.add_argument("nbytes", type=int)
    ap.add_argument("--name", default="writer")
    ap.add_argument("--kind", default="trainer")
    ap.add_argument("--run-dir", required=True)
    a = ap.parse_args()
    t = connect(name=a.name, run_dir=a.run_dir, kind=a.kind)
    w = MutableWriter.create(t, a.key, a.nbytes)
    for b in (0, 1):
        ctypes.memset(w.base(b), 1, a.nbytes)
    w.seal()
    print(json.dumps({"event": "ready", "version": w.version}), flush=True)
    half = a.nbytes // 2
    for line in sys.stdin:
        op, val = line.split()
        if op == "write":
            b = w.begin_write()
            ctypes.memset(w.base(b), int(val), half)
            print(json.dumps({"event": "writing", "buffer": b}), flush=True)
        else:
            assert w.writing is not None
            ctypes.memset(w.base(w.writing) + half, int(val), a.nbytes - half)
            print(json.dumps({"event": "published", "version": w.publish()}), flush=True)


if __name__ == "__main__":
    main()
