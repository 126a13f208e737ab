"""Restart state: what a daemon leaves for the next one, and the recovery it starts.

``state.json`` in the run directory (private: 0600, written atomically) records the
live tenants' pids, uids and names and the next group id. A new daemon that finds live
pids there *recovers*: it grants nothing (``BUSY``) until those tenants have registered
again and adopted what they still map, or ``recover_timeout_s`` passed; only they may
adopt, only once, and only their names are kept for them meanwhile. The file is removed
only after a clean, requested stop that leaves no tenant behind, never on a crash path.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import psutil

from kvpool import paths

if TYPE_CHECKING:
    from kvpool.daemon.tenants import TenantRecord

log = logging.getLogger("kvpool.daemon")

STATE_FILE = "state.json"


@dataclass
class Recovery:
    """The previous daemon's tenants that have not come back yet.

    Invariant: ``active`` only while ``pids`` is not empty and ``until`` has not passed
    (:meth:`finish_if_done` ends it); ``names``/``uids`` describe only those pids."""

    active: bool = False
    pids: set[int] = field(default_factory=set)  # tenants of a previous daemon, not back yet
    names: dict[str, int] = field(default_factory=dict)  # their names -> pids (kept for them)
    uids: dict[int, int] = field(default_factory=dict)  # their pids -> uids (a reused pid is not them)
    until: float = 0.0

    def begin(self, pids: set[int], names: dict[str, int], uids: dict[int, int],
              until: float) -> None:
        self.active = bool(pids)
        self.pids, self.names, self.uids, self.until = set(pids), names, uids, until

    def finish_if_done(self, now: float) -> bool:
        """End recovery once every tenant is back or time is up; True when it just ended."""
        if self.active and (now >= self.until or not self.pids):
            self.active = False
            return True
        return False

    def returned(self, pid: int) -> None:
        """``pid`` adopted (or its session ended): stop waiting for it."""
        self.pids.discard(pid)

    def is_expected(self, pid: int, uid: int) -> bool:
        """Was ``pid`` (with this ``uid``) a tenant of the previous daemon, not back yet?"""
        return pid in self.pids and self.uids.get(pid, uid) == uid

    def keeper_of(self, name: str, pid: int, uid: int) -> int | None:
        """The pid ``name`` is kept for while recovering, when that is not ``pid``/``uid``."""
        owner = self.names.get(name)
        if self.active and owner is not None and owner in self.pids and (
                owner != pid or self.uids.get(owner, uid) != uid):
            return owner
        return None


class StateFile:
    """``state.json`` of one run directory."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / STATE_FILE

    def load(self) -> dict[str, Any] | None:
        """The previous daemon's state, or None when there is none (or it is unreadable)."""
        try:
            state = json.loads(paths.read_private(self.path))
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def save(self, next_group: int, tenants: list[TenantRecord],
             next_groups: dict[int, int] | None = None) -> None:
        """``tenants`` (each with its device) and the next group id (the first
        device's; ``next_groups``: every device's, by ordinal)."""
        state = {"next_group": next_group, "tenants": [
            {"pid": t.pid, "uid": t.uid, "name": t.name, "device": t.device}
            for t in tenants]}
        if next_groups:
            state["next_groups"] = {str(d): n for d, n in next_groups.items()}
        try:
            paths.write_private(self.path, json.dumps(state).encode())
        except OSError as e:
            log.warning("cannot save %s: %s", self.path, e)

    def remove(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def live_tenants(state: dict[str, Any]) -> tuple[set[int], dict[str, int], dict[int, int]]:
    """``(pids, names -> pid, pid -> uid)`` of the recorded tenants still alive (not us)."""
    recorded = state.get("tenants", [])
    pids = {int(t["pid"]) for t in recorded
            if int(t.get("pid", 0)) > 0 and psutil.pid_exists(int(t["pid"]))}
    pids.discard(os.getpid())
    names = {str(t.get("name", "")): int(t["pid"]) for t in recorded
             if int(t.get("pid", 0)) in pids}
    uids = {int(t["pid"]): int(t["uid"]) for t in recorded
            if int(t.get("pid", 0)) in pids and "uid" in t}
    return pids, names, uids


def devices_of(state: dict[str, Any], first: int) -> dict[int, set[int]]:
    """pid -> the devices its recorded tenants held memory on (``first`` when the state
    does not say: a one-device daemon's; one process may hold memory on several)."""
    out: dict[int, set[int]] = {}
    for t in state.get("tenants", []):
        try:
            out.setdefault(int(t["pid"]), set()).add(int(t.get("device", first)))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def next_group_of(state: dict[str, Any], device: int, first: int) -> int:
    """The next group id ``device`` continues from."""
    try:
        return int(state.get("next_groups", {}).get(str(device),
                   state.get("next_group", 1) if device == first else 1))
    except (AttributeError, TypeError, ValueError):
        return 1


# (pids, names -> pid, pid -> uid, next group id, until): ``Arbiter.begin_recovery``
BeginRecovery = Callable[[set[int], dict[str, int], dict[int, int], int, float], None]


def recover(state_file: StateFile, begin: BeginRecovery, timeout_s: float) -> None:
    """Read the previous daemon's tenants and ``begin`` recovery: grants wait until the
    live ones adopted (or ``timeout_s``); group ids continue where it stopped."""
    state = state_file.load()
    if state is None:
        return
    pids, names, uids = live_tenants(state)
    begin(pids, names, uids, int(state.get("next_group", 1)),
                           time.monotonic() + timeout_s)
    if pids:
        log.info("recovering: waiting up to %gs for %d tenants of the previous daemon",
                 timeout_s, len(pids))
