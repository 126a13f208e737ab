"""What the daemon tests' tenant worker processes (``worker.py``, ``handoff_worker.py``)
share: one JSON object per line on stdout (:func:`emit`), the options every mode takes
(:func:`parser`), the mode dispatch in which an exception becomes one ``error`` event and
exit status 1 (:func:`run`), and :func:`sleep_forever` for a tenant that just holds.

Imported both ways: as ``daemon.worker_cli`` by tests that import a worker, and as
``worker_cli`` by a worker run as a script (its folder is then on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Callable, NoReturn


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def parser(modes: list[str], name: str, capacity: int) -> argparse.ArgumentParser:
    """``mode`` (one of ``modes``), ``--name``, ``--run-dir``, ``--regions``, ``--capacity``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=modes)
    ap.add_argument("--name", default=name)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=capacity)
    return ap


def run(ap: argparse.ArgumentParser, modes: dict[str, Callable[[argparse.Namespace], None]]) -> None:
    """Parse the command line and run its mode; any exception: an ``error`` event, exit 1."""
    args = ap.parse_args()
    try:
        modes[args.mode](args)
    except Exception as e:
        emit(event="error", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        sys.exit(1)


def sleep_forever() -> NoReturn:
    """Hold what the tenant holds until the test kills the process."""
    while True:
        time.sleep(1)
