"""The daemon tests' fixtures (a real daemon subprocess) for the fleet tests."""

from __future__ import annotations

from daemon.conftest import start_daemon  # noqa: F401  (re-exported fixture)
