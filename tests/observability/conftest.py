"""Observability tests reuse the daemon tests' fixtures (a real daemon subprocess)."""

from daemon.conftest import arb, daemon, make_arb, start_daemon  # noqa: F401
