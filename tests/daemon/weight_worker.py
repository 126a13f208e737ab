"""A tenant process for the weight-set tests: ``create KEY NBYTES`` (loads a pattern and
stops before sealing, or seals with ``--seal``), ``attach KEY`` (holds it), or ``write
KEY`` (attaches, then writes through the read-only mapping: it must die of SIGSEGV or
SIGBUS). Prints one JSON line ``{"event": "ready", ...}`` and then waits for stdin EOF.
``--fork``: a child is forked once the set is held; it keeps the descriptors and the
mapping, holds no session of its own, and waits for stdin EOF too (its pid is in the
ready line as ``child``)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

from kvpool.client_lib import connect
from kvpool.client_lib.weights import WeightSet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["create", "attach", "write"])
    ap.add_argument("key")
    ap.add_argument("nbytes", type=int, nargs="?", default=0)
    ap.add_argument("--seal", action="store_true")
    ap.add_argument("--fork", action="store_true")
    ap.add_argument("--name", default="weights-worker")
    ap.add_argument("--run-dir", required=True)
    a = ap.parse_args()
    t = connect(name=a.name, run_dir=a.run_dir)
    if a.action == "create":
        ws = WeightSet.create(t, a.key, a.nbytes)
        ws.view[:] = bytes(i % 251 for i in range(a.nbytes))
        if a.seal:
            ws.seal()
    else:
        ws = WeightSet.attach(t, a.key)
    child = os.fork() if a.fork else 0
    if a.fork and child == 0:  # keeps what it inherited (descriptors, mapping) until EOF
        sys.stdin.read()
        os._exit(0)
    print(json.dumps({"event": "ready", "state": ws.state, "first": ws.view[0],
                      "child": child}), flush=True)
    if a.action == "write":
        ctypes.memset(ws.base, 0x41, 16)  # read-only mapping: the process dies here
        print(json.dumps({"event": "wrote"}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
