"""The command loop the engine worker processes share (pd_worker.py, warm_worker.py):
one JSON command per stdin line, one JSON event per stdout line. Imported by those
scripts as a sibling module (a script's own directory is first on ``sys.path``)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any, Callable

Handler = Callable[[Any, dict], None]


def arguments() -> argparse.ArgumentParser:
    """The options every worker takes: the model, the daemon, its tenant name, KV size."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--kv", default="2MiB")
    return ap


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def finish_all(engine: Any) -> dict[str, list[int]]:
    """Step ``engine`` until every request ends; each one's output tokens by id."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.output_token_ids
    return out


def integrity(engine: Any) -> str:
    """``engine.check_integrity()``: "ok", or what it found (the giver of a handoff
    reports it with ``settled``, so every handoff test checks both sides)."""
    try:
        engine.check_integrity()
    except AssertionError as e:
        return f"broken: {e}"
    return "ok"


def check(engine: Any, msg: dict) -> None:
    """``check``: engine and pool integrity; prints ``ok`` with the used block count."""
    engine.check_integrity()
    emit(event="ok", used=engine.pool.num_used_blocks)


def serve(engine: Any, handlers: dict[str, Handler]) -> None:
    """Print ``ready``, then run ``handlers[cmd](engine, msg)`` for each line (``check``
    built in); a failing command prints an ``error`` event (the next one still runs);
    the engine is closed at the end of stdin."""
    handlers = {"check": check, **handlers}
    emit(event="ready")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            handlers[msg["cmd"]](engine, msg)
        except Exception as e:  # noqa: BLE001 - the test reads it
            emit(event="error", error=f"{type(e).__name__}: {e}",
                 trace=traceback.format_exc())
    engine.close()
