"""Spellings renamed in this release, still accepted until the next one (issue 35 item 7).

The fair-share knob of a tenant was called ``weight``, beside the model *weights* of
``KVPOOL_WEIGHTS``, ``--weights`` and weight sets. It is now ``shares`` (a proportional
count, like cgroup ``cpu.shares``): the ``KVPOOL_SHARES`` variable, the ``--shares``
flag (``kvpool limit``, ``kvpool lease``), the fleet file's ``[[models]] shares`` and the
daemon config's ``[tenants.NAME] shares``. Each old spelling (``KVPOOL_WEIGHT``,
``--weight``, ``weight``) still works for one release and prints one line on stderr
(:func:`deprecated_line`); giving the old and the new spelling together is refused with
one line (:func:`both_line`). On the wire the field is simply renamed (protocol
version 3): the client and the daemon ship in one package.

No daemon, torch or click imports: the CLI, the engine adapters' settings, the fleet
file and the daemon's config all read their old spellings through here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

_said: set[str] = set()


def deprecated_line(old: str, new: str, where: str = "") -> str:
    """The one line an old spelling prints (``where``: the file and table it is in)."""
    return f"kvpool: {where}{old} is deprecated, use {new} (removed in the next release)"


def both_line(old: str, new: str) -> str:
    """Why the old and new spelling of one setting together are refused."""
    return f"{new} and {old} are both given: {old} is the old name of {new}; give {new} only"


def say(line: str, once: bool = False) -> None:
    """``line`` on stderr, flushed; ``once``: only the first time in this process (an
    environment variable read by several parts of one engine)."""
    if once and line in _said:
        return
    _said.add(line)
    print(line, file=sys.stderr, flush=True)


def renamed_env(env: Mapping[str, str], old: str, new: str) -> Mapping[str, str]:
    """``env`` with the deprecated variable ``old`` read as ``new`` (its line said, once
    per process). Raises ValueError (:func:`both_line`) when both are set."""
    if old not in env:
        return env
    if new in env:
        raise ValueError(both_line(old, new))
    say(deprecated_line(old, new), once=True)
    out = {k: v for k, v in env.items() if k != old}
    out[new] = env[old]
    return out


def renamed_key(table: Mapping[str, object], old: str, new: str, where: str = ""
                ) -> tuple[dict[str, object], str | None]:
    """A config ``table`` (a TOML table; ``where`` its place, ``"fleet.toml: models[0]."``)
    with the deprecated key ``old`` read as ``new`` (its line said), and None; or the
    table as it is and the problem (:func:`both_line`) when both keys are there."""
    out = dict(table)
    if old not in out:
        return out, None
    if new in out:
        return out, both_line(old, new)
    say(deprecated_line(old, new, where))
    out[new] = out.pop(old)
    return out, None
