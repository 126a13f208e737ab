"""Where the daemon's sockets live, and the rules that make that place trustworthy.

Resolution (daemon and clients alike): an explicit ``--run-dir``; ``$KVPOOL_RUN_DIR``;
``/run/kvpool`` when it exists and is usable (the systemd unit creates it with
``RuntimeDirectory=kvpool``) — and always for root, which never falls back to a
world-writable ``/tmp``; ``$XDG_RUNTIME_DIR/kvpool``; ``/tmp/kvpool-$UID``.

Trust rules (see ``docs/ARCHITECTURE.md``, "Run directory, daemon identity, configuration"):

* the daemon serves only from a directory that is not a symlink, is owned by its own
  uid and is writable by nobody else, below directories that only root or that uid can
  change (sticky ones such as ``/tmp`` excepted): :func:`ensure_run_dir`;
* files in it are written through a fresh ``O_EXCL | O_NOFOLLOW`` temporary file and a
  rename, read with ``O_NOFOLLOW``: :func:`write_private`, :func:`read_private`;
* a client talks only to a run directory owned by a trusted uid (root, its own, the
  ``kvpool`` system user, or ``$KVPOOL_DAEMON_UID``) and checks that the process
  behind ``pages.sock`` runs as one of them (:func:`trusted_daemon_uids`,
  :func:`check_daemon_dir`; the ``SO_PEERCRED`` check is in ``client_lib/connection``).
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import stat
from pathlib import Path

SYSTEM_RUN_DIR = "/run/kvpool"
SYSTEM_USER = "kvpool"  # the unit's User=; its uid is trusted by clients
CONTROL_SOCKET = "control.sock"
PAGES_SOCKET = "pages.sock"
MAX_PRIVATE_FILE = 16 << 20  # read_private refuses larger files


class UnsafePath(PermissionError):
    """A run directory (or a file in it) that another user could control."""


def _usable(path: Path) -> bool:
    """True when ``path`` is a directory this process can serve from or connect into."""
    if not path.is_dir():
        return False
    if (path / CONTROL_SOCKET).exists():
        return os.access(path / CONTROL_SOCKET, os.R_OK | os.W_OK)
    return os.access(path, os.W_OK | os.X_OK)


def run_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The run directory to use (not created; see :func:`ensure_run_dir`)."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("KVPOOL_RUN_DIR")
    if env:
        return Path(env)
    system = Path(SYSTEM_RUN_DIR)
    if os.geteuid() == 0 or _usable(system):
        return system
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "kvpool"
    return Path(f"/tmp/kvpool-{os.getuid()}")


# ---- the daemon's side ------------------------------------------------------------------
def check_ancestors(path: Path, trusted: set[int]) -> None:
    """Refuse ``path`` when a directory above it could be changed by an untrusted user
    (owned by someone else, or group/world-writable without the sticky bit), so the
    directory cannot be swapped out from under a check. Symlinks above it are followed
    (then checked the same way) only when a trusted uid owns them."""
    absolute = Path(os.path.abspath(path))
    for chain in (absolute.parent, Path(os.path.realpath(absolute.parent))):
        for d in [*reversed(chain.parents), chain]:
            st = os.lstat(d)
            if st.st_uid not in trusted:
                raise UnsafePath(f"{d} (above the run directory {path}) is owned by uid "
                                 f"{st.st_uid}, who could replace it")
            if stat.S_ISLNK(st.st_mode):
                continue
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise UnsafePath(f"{d} (above the run directory {path}) is writable by "
                                 f"group or others and not sticky")


def _check_dir_stat(path: Path, st: os.stat_result, owners: set[int]) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"run directory {path} is a symlink (refusing to follow it)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"run directory {path} is not a directory")
    if st.st_uid not in owners:
        raise UnsafePath(f"run directory {path} is owned by uid {st.st_uid}, not by "
                         f"{' or '.join(f'uid {u}' for u in sorted(owners))}")
    if st.st_mode & 0o022:
        raise UnsafePath(f"run directory {path} is writable by group or others "
                         f"(mode {stat.S_IMODE(st.st_mode):04o})")


def ensure_run_dir(path: Path, mode: int = 0o750) -> Path:
    """Create the daemon's run directory if missing (``mode``, 0750) and make sure it is
    safe to serve from; raises :class:`UnsafePath` (an ``OSError``) when it is not.

    Invariants on return: ``path`` is a real directory (never a symlink), owned by this
    process's effective uid, with mode exactly ``mode`` (set through a descriptor opened
    with ``O_NOFOLLOW``), under ancestors only root or this uid can change."""
    me = os.geteuid()
    trusted = {0, me}
    path = Path(os.path.abspath(path))
    if not os.path.lexists(path.parent):
        os.makedirs(path.parent, mode=0o755, exist_ok=True)
    check_ancestors(path, trusted)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        _check_dir_stat(path, os.lstat(path), {me})  # names why (symlink, not a dir)
        raise
    try:
        _check_dir_stat(path, os.fstat(fd), {me})
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path


def write_private(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Replace ``path`` with ``data`` atomically, never following a symlink: the bytes go
    to a fresh temporary file (``O_CREAT | O_EXCL | O_NOFOLLOW``, random name, same
    directory) which is then renamed over ``path`` (a rename replaces a symlink itself,
    never its target)."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_private(path: Path) -> bytes:
    """The bytes of ``path``, a regular file owned by this process's uid; refuses
    symlinks, FIFOs and devices (:class:`UnsafePath`) and files over 16 MiB."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symlink (refusing to follow it)") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafePath(f"{path} is not a regular file of uid {os.geteuid()}")
        if st.st_size > MAX_PRIVATE_FILE:
            raise UnsafePath(f"{path} is larger than {MAX_PRIVATE_FILE} bytes")
        return f.read(MAX_PRIVATE_FILE + 1)


# ---- the client's side ------------------------------------------------------------------
def trusted_daemon_uids(environ: dict[str, str] | None = None) -> set[int]:
    """The uids a client accepts as its daemon: root, its own, the ``kvpool`` system
    user (if it exists), and those in ``$KVPOOL_DAEMON_UID`` (comma-separated uids or
    user names). Raises ValueError for a name that does not resolve."""
    env = os.environ if environ is None else environ
    uids = {0, os.getuid(), os.geteuid()}
    try:
        uids.add(pwd.getpwnam(SYSTEM_USER).pw_uid)
    except KeyError:
        pass
    for item in filter(None, (s.strip() for s in env.get("KVPOOL_DAEMON_UID", "").split(","))):
        if item.isdigit():
            uids.add(int(item))
            continue
        try:
            uids.add(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ValueError(f"KVPOOL_DAEMON_UID: no user named {item!r}") from None
    return uids


def check_daemon_dir(path: Path, trusted: set[int]) -> None:
    """Refuse a run directory a client must not trust: a symlink, owned by an untrusted
    uid, writable by group or others, or under directories an untrusted uid could change
    (:class:`UnsafePath`). ``FileNotFoundError`` when it does not exist."""
    path = Path(os.path.abspath(path))
    st = os.lstat(path)
    _check_dir_stat(path, st, trusted)
    check_ancestors(path, trusted)


def control_endpoint(path: Path) -> str:
    return f"ipc://{path / CONTROL_SOCKET}"


def control_path(path: Path) -> Path:
    return path / CONTROL_SOCKET


def pages_path(path: Path) -> Path:
    return path / PAGES_SOCKET
