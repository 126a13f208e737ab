"""Errors a kvpool client sees. ``code`` is the daemon's stable error code."""

from __future__ import annotations

from kvpool import protocol as p


class KvpoolError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class NoMemory(KvpoolError):
    """The daemon's budget cannot supply the pages (``NO_MEMORY``)."""


class OverLimit(KvpoolError):
    """The grant would take this tenant past its limit (``OVER_LIMIT``)."""


class ProtocolError(KvpoolError):
    """The daemon answered with a reply of another type than the request gets."""


class DaemonUnavailable(KvpoolError):
    """No daemon answers at the run directory, or it stopped answering."""


_BY_CODE = {p.NO_MEMORY: NoMemory, p.OVER_LIMIT: OverLimit}


def from_reply(err: p.Error) -> KvpoolError:
    return _BY_CODE.get(err.code, KvpoolError)(err.code, err.message)


class StepTooLarge(OverLimit):
    """A training step asked for more memory than the trainer may ever hold (its
    ``max`` or the budget, with its state): refused before anything was taken."""


class StepDeadline(NoMemory):
    """A training step's memory was not granted before the step's deadline (the other
    tenants could not give enough back in time); nothing of the step is held."""
