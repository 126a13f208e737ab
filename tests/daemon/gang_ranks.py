"""Gang ranks as real processes, cheap to start and to kill -9 (the gang tests).

``python tests/daemon/gang_ranks.py`` is a *zygote*: it imports the client library once,
then for each line ``{"rank": r, ...}`` on stdin forks a child that becomes that rank
(its own process, its own session: SO_PEERCRED sees its pid) and prints the child's pid.
A child connects back to the harness's Unix socket (``"sock"``), says
``{"pid", "rank", "token"}`` and then answers one JSON line per command:

* ``{"op": "grant"|"release", "units": [...]}`` -> ``{"ok": true}`` or
  ``{"ok": false, "code": ..., "msg": ...}`` (collective: every rank sends the same);
* ``{"op": "units"}`` -> ``{"units": [...]}`` (what this rank maps);
* ``{"op": "ended", "timeout": s}`` -> ``{"ended": reason or null}`` (GangEnded seen);
* ``{"op": "close"}`` -> closes the session and exits.

A reclaim ask (mirrored to every rank of a gang) releases the highest units it needs:
every rank maps the same units and gets the same ask, so the parts match.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvpool.client_lib import connect  # noqa: E402
from kvpool.client_lib.errors import KvpoolError  # noqa: E402


def rank_main(spec: dict) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(spec["sock"])
    f = conn.makefile("rw", buffering=1)
    layout = [tuple(x) for x in spec["layout"]]
    n_regions, capacity = layout[0]
    token = spec.get("token")
    try:
        if spec["rank"] == 0:
            t = connect(spec["name"], device=spec["devices"][0], run_dir=spec["run_dir"])
            token = t.create_gang(spec["devices"], layout)
        else:
            t = connect(spec["name"], device=spec["devices"][spec["rank"]],
                        run_dir=spec["run_dir"], gang=token, rank=spec["rank"], layout=layout)
        g = t.region_group(n_regions, capacity)
    except KvpoolError as e:
        f.write(json.dumps({"pid": os.getpid(), "rank": spec["rank"], "error": str(e)}) + "\n")
        return
    ended = threading.Event()
    t.on_gang_end = lambda reason: ended.set()
    lock = threading.Lock()

    def shrink(nbytes: int, urgent: bool) -> None:
        with lock:
            mapped = sorted(g.mapped)
        k = min(len(mapped), -(-nbytes // g.unit_bytes))
        if k:
            try:
                g.release(mapped[-k:])
            except (KvpoolError, ValueError):
                pass
    t.set_shrink_callback(shrink)
    f.write(json.dumps({"pid": os.getpid(), "rank": spec["rank"], "token": token}) + "\n")
    for line in f:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "grant":
                g.grant(cmd["units"])
                out: dict = {"ok": True}
            elif op == "release":
                g.release(cmd["units"])
                out = {"ok": True}
            elif op == "units":
                out = {"units": sorted(g.mapped)}
            elif op == "ended":
                ended.wait(cmd.get("timeout", 10))
                out = {"ended": t.gang_ended}
            elif op == "close":
                t.close()
                f.write(json.dumps({"ok": True}) + "\n")
                return
            else:
                out = {"ok": False, "code": "TEST", "msg": f"unknown op {op}"}
        except KvpoolError as e:
            out = {"ok": False, "code": e.code, "msg": e.message}
        except ValueError as e:
            out = {"ok": False, "code": "CLIENT", "msg": str(e)}
        f.write(json.dumps(out) + "\n")


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                sys.stdin.close()
                rank_main(spec)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
