"""Typed errors the engine raises to its callers."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model folder is missing files, has unexpected/missing/misshaped tensors or an
    unsupported config; the message names what is wrong."""


class PoolExhausted(RuntimeError):
    """``BlockPool.get_new_blocks`` cannot hand out the requested number of blocks now."""


class RequestError(ValueError):
    """A request the engine cannot accept (prompt too long, bad parameters, ...)."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take a request now (an asleep model that could not wake); the
    server answers 503 with this one-line message."""


class EngineBroken(EngineUnavailable):
    """The engine can never serve again (a tensor-parallel rank died): every request and
    ``/health`` get 503 with this one-line message; only a restart of the server helps
    (a supervisor reads ``/health``)."""
