"""One generic registry: things of one kind by the name a configuration gives them.

The vmm backends (:data:`kvpool.vmm.registry.REGISTRY`), the daemon's reclaim policies
(:data:`kvpool.daemon.policy.POLICIES`), the fleet's server kinds
(:data:`kvpool.fleet.engines.KINDS`), its routing pickers
(:data:`kvpool.fleet.balance.PICKERS`) and its policies
(:data:`kvpool.fleet.policies.FLEET_POLICIES`) are each one :class:`Registry`. Configuration
checks (the daemon's config, the fleet file, the CLI's choices) ask the registry for its
:meth:`~Registry.names` instead of copying them, so a new entry is one ``register``.

(Not the daemon's tenant registry, :mod:`kvpool.daemon.registry`: that one is state.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "UnknownName"]


class UnknownName(ValueError):
    """A name no entry of the registry has; the message is one line naming the known
    names (``unknown routing 'x' (one of least_loaded, round_robin, prefix)``)."""


class Registry(Generic[T]):
    """Entries of one kind by name, in the order they were registered. ``what`` names
    the kind in messages ("backend", "routing"...). Callers register every entry at
    import (a registry is filled once, then only read)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name`` (not empty, not registered yet: ValueError);
        returns the entry."""
        if not name or name in self._entries:
            raise ValueError(f"{self.what} {name!r}: empty or registered twice")
        self._entries[name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._entries)

    def entries(self) -> tuple[T, ...]:
        """Every entry, in registration order."""
        return tuple(self._entries.values())

    def lookup(self, name: str) -> T:
        """The entry registered under ``name``; :class:`UnknownName` otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # (TypeError: an unhashable name from hostile input)
            raise UnknownName(self.unknown(name)) from None

    def unknown(self, name: object) -> str:
        """The one line :meth:`lookup` raises for ``name``."""
        return f"unknown {self.what} {name!r} (one of {', '.join(self._entries)})"

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
