"""Observability tests reuse the daemon tests' fixtures (a real daemon subprocess)."""

from daemon.conftest import daemon, start_daemon  # noqa: F401
