"""Where the daemon's sockets live: one resolution rule shared by daemon and clients.

Order: an explicit ``--run-dir``; ``$KVPOOL_RUN_DIR``; ``/run/kvpool`` when it exists
and is usable (the systemd unit creates it with ``RuntimeDirectory=kvpool``);
``$XDG_RUNTIME_DIR/kvpool``; ``/tmp/kvpool-$UID``.
"""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_RUN_DIR = "/run/kvpool"
CONTROL_SOCKET = "control.sock"
PAGES_SOCKET = "pages.sock"


def _usable(path: Path) -> bool:
    """True when ``path`` is a directory this process can serve from or connect into."""
    if not path.is_dir():
        return False
    if (path / CONTROL_SOCKET).exists():
        return os.access(path / CONTROL_SOCKET, os.R_OK | os.W_OK)
    return os.access(path, os.W_OK | os.X_OK)


def run_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The run directory to use (not created; see :func:`ensure_run_dir`)."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("KVPOOL_RUN_DIR")
    if env:
        return Path(env)
    system = Path(SYSTEM_RUN_DIR)
    if _usable(system):
        return system
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "kvpool"
    return Path(f"/tmp/kvpool-{os.getuid()}")


def ensure_run_dir(path: Path, mode: int = 0o750) -> Path:
    """Create the daemon's run directory if missing (mode 0750; sockets are 0660)."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    return path


def control_endpoint(path: Path) -> str:
    return f"ipc://{path / CONTROL_SOCKET}"


def control_path(path: Path) -> Path:
    return path / CONTROL_SOCKET


def pages_path(path: Path) -> Path:
    return path / PAGES_SOCKET
