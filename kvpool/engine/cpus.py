"""Pin an engine process to a set of CPUs: ``kvpool serve --cpus 0,1`` (and
``--prefill-cpus`` / ``--decode-cpus`` for the halves of ``--pd``).

Invariants:

* :func:`parse` accepts only CPUs this process may run on now (its affinity set) and
  says in one line which one it refuses and why; it never touches the process.
* After :func:`pin` every thread of the process (those running now and, by inheritance,
  those started later) may run on exactly ``cpus``, and torch uses ``len(cpus)`` intra-op
  threads. A prefill/decode pair on one machine gets its halves their own cores this way,
  as one GPU would give them their own SMs or streams.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def allowed() -> set[int]:
    """The CPUs this process may run on now."""
    return set(os.sched_getaffinity(0))


def parse(text: str, may: set[int] | None = None) -> list[int]:
    """``"0"``, ``"0,2"``, ``"0-3"``, ``"0-1,4"`` -> sorted CPU numbers, each one in ``may``
    (default :func:`allowed`); ``ValueError`` with a one-line reason otherwise."""
    may = allowed() if may is None else may
    got: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list (e.g. 0 or 0,1 or 0-3)") from None
        if a < 0 or b < a:
            raise ValueError(f"{part.strip()!r} in {text!r} is not a CPU range")
        got.update(range(a, b + 1))
    outside = sorted(got - may)
    if outside:
        raise ValueError(f"CPU {outside[0]} is not one this process may use "
                         f"(allowed: {format_list(sorted(may))})")
    return sorted(got)


def format_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's Cpus_allowed_list style)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin(cpus: Sequence[int]) -> int:
    """Restrict every thread of this process to ``cpus`` and give torch ``len(cpus)``
    intra-op threads; returns the thread count torch reports afterwards.
    ``OSError`` when the kernel refuses the set."""
    mask = set(cpus)
    for tid in _threads():  # sched_setaffinity(0) would move the calling thread only
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    os.environ["OMP_NUM_THREADS"] = str(len(mask))  # for a pool not started yet
    import torch

    torch.set_num_threads(len(mask))
    return int(torch.get_num_threads())


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return [0]


def choose(role: str, pd: bool, cpus: str | None, prefill_cpus: str | None,
           decode_cpus: str | None) -> list[int] | None:
    """The CPUs ``kvpool serve`` pins this process to (None: leave it as it is), from its
    ``--cpus`` / ``--prefill-cpus`` / ``--decode-cpus``: a prefill server takes
    ``--prefill-cpus``, a decode server or a ``--pd`` front ``--decode-cpus``, each
    falling back to ``--cpus``. Every list given is checked here, so a ``--pd`` front
    refuses a bad ``--prefill-cpus`` before it starts its prefill child."""
    if role == "both" and not pd and (prefill_cpus or decode_cpus):
        raise ValueError("--prefill-cpus/--decode-cpus need --pd (or --role prefill/decode)")
    got: dict[str, list[int] | None] = {}
    for flag, text in (("--cpus", cpus), ("--prefill-cpus", prefill_cpus),
                       ("--decode-cpus", decode_cpus)):
        try:
            got[flag] = None if text is None else parse(text)
        except ValueError as e:
            raise ValueError(f"{flag} {text}: {e}") from None
    if role == "prefill":
        return got["--prefill-cpus"] or got["--cpus"]
    if role == "decode" or pd:
        return got["--decode-cpus"] or got["--cpus"]
    return got["--cpus"]


def pin_and_say(cpus: Sequence[int], who: str = "kvpool serve") -> None:
    """:func:`pin`, then one line on stderr saying what holds now (read back, not
    assumed); a refused set becomes ``RuntimeError`` with one line."""
    import sys

    try:
        threads = pin(cpus)
    except OSError as e:
        raise RuntimeError(f"cannot pin to CPUs {format_list(cpus)}: {e.strerror}") from None
    now = format_list(sorted(os.sched_getaffinity(0)))
    print(f"{who}: pinned to CPUs {now} ({threads} torch thread"
          f"{'s' if threads != 1 else ''})", file=sys.stderr, flush=True)
