"""Start-up and run-directory safety: the daemon's sockets, opened only where it is safe.

:func:`open_sockets` makes sure the run directory is safe to serve from
(:func:`kvpool.paths.ensure_run_dir`: ours, not a symlink, not writable by others),
refuses to start when another daemon answers there (:class:`AlreadyRunning`), hands the
directory (setgid) and both sockets to ``socket_group`` so no client ever sees them
owned by the wrong group, binds the ZeroMQ ROUTER (frame-size capped) and listens on the
fd channel. Every failure is a :class:`StartupError` with one clear line;
:meth:`Sockets.close` undoes what was opened and never touches another daemon's sockets.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.daemon.config import Config

MAX_ZMQ_MESSAGE = 2 * p.MAX_FRAME  # larger frames make libzmq drop the peer (memory guard)


class StartupError(RuntimeError):
    """The daemon cannot start (sockets, permissions, configuration)."""


class AlreadyRunning(StartupError):
    pass


@dataclass
class Sockets:
    """What a started daemon listens on. ``router``/``listener`` are None until bound."""

    run_dir: Path
    ctx: zmq.Context[zmq.Socket[bytes]] = field(default_factory=zmq.Context)
    router: zmq.Socket[bytes] | None = None
    listener: socket.socket | None = None

    def close(self) -> None:
        """Close what is open; remove the socket files only when this daemon bound them."""
        if self.router is not None:
            self.router.close(linger=0)
            self.router = None
        self.ctx.term()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            remove_socket_files(self.run_dir)


def remove_socket_files(run_dir: Path) -> None:
    for path in (paths.control_path(run_dir), paths.pages_path(run_dir)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def prepare_run_dir(run_dir: Path) -> None:
    try:
        paths.ensure_run_dir(run_dir)
    except paths.UnsafePath as e:
        raise StartupError(f"refusing to serve: {e}") from None
    except OSError as e:
        raise StartupError(f"cannot create the run directory {run_dir}: {e}") from None


def group_id(name: str, what: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise StartupError(f"{what} {name!r} does not exist") from None


def refuse_if_running(run_dir: Path) -> None:
    """:class:`AlreadyRunning` when a daemon answers on this run directory's fd channel."""
    with contextlib.suppress(OSError), fdchannel.connect(str(paths.pages_path(run_dir))):
        raise AlreadyRunning(f"a daemon already serves {run_dir}")


def give_to_group(run_dir: Path, cfg: Config, what: str, *targets: Path) -> None:
    """chown ``targets`` to ``socket_group`` (the directory also setgid, 0750)."""
    if not cfg.socket_group:
        return
    try:
        gid = grp.getgrnam(cfg.socket_group).gr_gid
        for path in targets:
            os.chown(path, -1, gid)
            if path == run_dir:
                os.chmod(run_dir, 0o2750)
    except (KeyError, OSError) as e:
        raise StartupError(f"cannot give {what} to group {cfg.socket_group!r}: {e}") from None


def open_sockets(cfg: Config, run_dir: Path, sockets: Sockets) -> None:
    """Bind ``sockets`` (filled in as they open, so a failure can close them)."""
    refuse_if_running(run_dir)
    router = sockets.router = sockets.ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_ZMQ_MESSAGE)
    router.setsockopt(zmq.SNDHWM, cfg.control_hwm)
    router.setsockopt(zmq.RCVHWM, cfg.control_hwm)
    control = paths.control_path(run_dir)
    with contextlib.suppress(FileNotFoundError):
        control.unlink()
    # The directory first, setgid: the sockets are born with the group, so no client
    # ever sees them (or the directory) owned by the wrong group.
    give_to_group(run_dir, cfg, "the run directory", run_dir)
    try:
        router.bind(paths.control_endpoint(run_dir))
        sockets.listener = fdchannel.listen(str(paths.pages_path(run_dir)),
                                            mode=cfg.socket_mode)
    except (zmq.ZMQError, OSError) as e:
        raise StartupError(f"cannot listen in {run_dir}: {e}") from None
    os.chmod(control, cfg.socket_mode)
    give_to_group(run_dir, cfg, "the sockets", control, paths.pages_path(run_dir))
    sockets.listener.setblocking(False)
