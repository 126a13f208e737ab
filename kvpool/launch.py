"""Starting kvpool daemons (and ``kvpool serve`` servers) as child processes: the one
launcher tests, benchmarks and the demo use (``tests/daemon/helpers.py``, ``kvpool.demo.cluster.Cluster.daemon``,
``benchmarks/*``). Imports neither torch nor the daemon: the child is
``python -P -m kvpool.cli.main daemon ...`` (:func:`module_argv`: the current directory
never shadows the package).

Invariants:

* :func:`daemon_argv` is the one place such a command line is built: the launcher
  (default ``python -P -m kvpool.cli.main``; a wrapper such as ``setpriv ... python -m
  kvpool.cli.main`` or a fault-injecting script replaces it), ``daemon --backend B
  --run-dir D``, ``--config``/``--budget``/``--page-size`` when given (else the
  daemon's defaults), then the caller's extra flags, in that order.
* A daemon *serves* once both of its sockets (``control.sock``, ``pages.sock``) exist in
  its run directory: it binds them after its start-up checks and before its event loop,
  so a connection made from then on is answered. :meth:`DaemonProcess.wait_serving`
  returns only then; if the process exits first, or the deadline passes, it raises
  :class:`DaemonStartError` whose message ends with the tail of the daemon's log.
  Socket files left by a killed daemon would count: :func:`restart` removes them first.
* A server (``kvpool serve``, vLLM) is *ready* once ``GET URL/health`` answers 200
  (:func:`wait_healthy`, stdlib HTTP, no proxy); it raises :class:`ChildStartError` if
  the process exits first or the deadline passes.
* :meth:`DaemonProcess.stop` always leaves the process reaped: SIGTERM (the daemon's
  clean stop), SIGKILL after ``grace_s``; a process already gone is not an error. With
  ``new_session`` the signals go to the child's whole process group.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvpool import paths

START_TIMEOUT_S = 30.0  # a daemon on a loaded 2-core machine binds in well under a second
STOP_GRACE_S = 10.0


class ChildStartError(RuntimeError):
    """A child exited before it was ready, or was not ready in time; says which, with its log."""


class DaemonStartError(ChildStartError):
    """The daemon exited before it served, or did not serve in time; says which, with its log."""


def module_argv(module: str) -> list[str]:
    """``python -m MODULE`` with this interpreter, the current directory kept off the
    module search path (``-P``; before 3.11, ``-c`` dropping it and :mod:`runpy`): a
    child started where a folder named ``kvpool`` lies (the folder holding a clone)
    imports the installed package, not that folder. Every kvpool child starts so."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", "import runpy, sys; del sys.path[0]; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]


def cli_argv() -> list[str]:
    """``python -P -m kvpool.cli.main`` with this interpreter (:func:`module_argv`): the
    default launcher."""
    return module_argv("kvpool.cli.main")


def daemon_argv(run_dir: str | os.PathLike[str], *extra: str,
                budget: str | int | None = None, page_size: int | None = None,
                backend: str = "host", config: str | os.PathLike[str] | None = None,
                launcher: Sequence[str] | None = None) -> list[str]:
    """The ``kvpool daemon`` command line for ``run_dir`` (see the module invariants);
    ``config`` is a TOML file (``--config``)."""
    argv = [*(launcher or cli_argv()), "daemon", "--backend", backend,
            "--run-dir", str(run_dir)]
    if config is not None:
        argv += ["--config", str(config)]
    if budget is not None:
        argv += ["--budget", str(budget)]
    if page_size is not None:
        argv += ["--page-size", str(page_size)]
    return [*argv, *extra]


def serving(run_dir: Path) -> bool:
    """Both daemon sockets exist in ``run_dir``."""
    return paths.control_path(run_dir).exists() and paths.pages_path(run_dir).exists()


def log_tail(log: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of ``log`` ('' when there is none)."""
    if log is None:
        return ""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_serving(popen: subprocess.Popen[bytes], run_dir: Path, log: Path | None = None,
                 timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once the daemon ``popen`` on ``run_dir`` serves; raise
    :class:`DaemonStartError` if it exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not serving(run_dir):
        if popen.poll() is not None:
            raise DaemonStartError(f"the daemon exited with code {popen.returncode} before "
                                   f"serving:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise DaemonStartError(f"the daemon did not serve within {timeout_s:g} s:\n"
                                   f"{log_tail(log)}")
        time.sleep(0.02)


def stop(popen: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S,
         group: bool = False) -> int:
    """SIGTERM (to the process group with ``group``), SIGKILL after ``grace_s``; returns
    the exit status, the process reaped."""
    if popen.poll() is None:
        _signal(popen, signal.SIGTERM, group)
        try:
            popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal(popen, signal.SIGKILL, group)
    return popen.wait()


def _signal(popen: subprocess.Popen[bytes], sig: signal.Signals, group: bool) -> None:
    try:
        if group:
            os.killpg(popen.pid, sig)
        else:
            popen.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone (or a setpriv child we may not signal: wait reaps it)


@dataclass
class DaemonProcess:
    """A daemon child process on ``run_dir`` whose output goes to ``log`` (None: inherited)."""

    run_dir: Path
    popen: subprocess.Popen[bytes]
    argv: list[str]
    log: Path | None = None
    env: dict[str, str] | None = None  # what was added to the parent's environment
    cwd: str | None = None
    new_session: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """:func:`wait_serving` for this daemon."""
        wait_serving(self.popen, self.run_dir, self.log, timeout_s)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """:func:`stop` for this daemon."""
        return stop(self.popen, grace_s, self.new_session)

    def kill(self) -> int:
        """SIGKILL at once (a crash: the daemon's restart state stays); returns the status."""
        if self.popen.poll() is None:
            _signal(self.popen, signal.SIGKILL, self.new_session)
        return self.popen.wait()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def serve_argv(model_dir: str | os.PathLike[str], *extra: str, port: int, name: str,
               kv_cache_size: str | int, elastic: bool = False,
               log_level: str = "warning") -> list[str]:
    """The ``kvpool serve`` command line of the bundled engine's OpenAI server on
    127.0.0.1:``port`` (``--elastic``: its KV memory from the daemon named by
    ``KVPOOL_RUN_DIR``), then the caller's extra flags."""
    return [*cli_argv(), "serve", str(model_dir), "--port", str(port), "--served-model-name",
            name, "--kv-cache-size", str(kv_cache_size), "--log-level", log_level,
            *(("--elastic",) if elastic else ()), *extra]


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """``GET url/health`` answers 200 (straight to the address: no proxy, stdlib only)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/health", timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except (OSError, http.client.HTTPException):
        return False


def wait_healthy(popen: subprocess.Popen[bytes], url: str, name: str, deadline: float,
                 logs: Callable[[], str] = lambda: "", poll_s: float = 0.2) -> None:
    """Return once the server ``popen`` at ``url`` is :func:`healthy`; raise
    :class:`ChildStartError` (ending with ``logs()``) if it exits first or the
    ``time.monotonic()`` ``deadline`` passes."""
    while not healthy(url):
        if popen.poll() is not None:
            raise ChildStartError(f"{name} exited with code {popen.returncode}:\n{logs()}")
        if time.monotonic() > deadline:
            raise ChildStartError(f"{name} not healthy in time:\n{logs()}")
        time.sleep(poll_s)


def spawn_process(argv: Sequence[str], log: Path | None = None,
                  env: Mapping[str, str] | None = None,
                  cwd: str | os.PathLike[str] | None = None, new_session: bool = False,
                  append: bool = False,
                  base_env: Mapping[str, str] | None = None,
                  die_with_parent: bool = False) -> subprocess.Popen[bytes]:
    """Start ``argv`` (a daemon's or a server's) without waiting; stdout and stderr go to
    ``log`` (appended to with ``append``), or are inherited when ``log`` is None; ``env``
    is added to ``base_env`` (default: this process's environment).

    ``die_with_parent`` (Linux): the child is SIGKILLed when this process dies, however
    it dies (SIGKILL included: ``PR_SET_PDEATHSIG``, armed before the child's exec; a
    parent already gone by then kills it at once). Caller's obligation: the kernel
    sends the signal when the *thread* that started the child ends, so call it from a
    thread that lives as long as the process (the main thread, or the event loop's)."""
    out = open(log, "ab" if append else "wb") if log is not None else None
    try:
        return subprocess.Popen(list(argv), stdout=out,
                                stderr=subprocess.STDOUT if out else None,
                                env={**(os.environ if base_env is None else base_env),
                                     **(env or {})},
                                cwd=None if cwd is None else str(cwd),
                                start_new_session=new_session,
                                preexec_fn=_deathsig(os.getpid()) if die_with_parent else None)
    finally:
        if out is not None:
            out.close()


PR_SET_PDEATHSIG = 1


def _deathsig(parent: int) -> Callable[[], None]:
    """The child's first step (before exec): SIGKILL when ``parent`` dies."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)) != 0 or os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # cannot be armed, or too late: go now

    return arm


def spawn(argv: Sequence[str], run_dir: str | os.PathLike[str], log: Path | None = None,
          env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
          new_session: bool = False, append: bool = False,
          die_with_parent: bool = False) -> DaemonProcess:
    """Start the daemon ``argv`` (from :func:`daemon_argv`) on ``run_dir`` without
    waiting (:func:`spawn_process`)."""
    popen = spawn_process(argv, log, env, cwd, new_session, append,
                          die_with_parent=die_with_parent)
    return DaemonProcess(Path(run_dir), popen, list(argv), log, dict(env or {}),
                         None if cwd is None else str(cwd), new_session)


def start_daemon(run_dir: str | os.PathLike[str], *extra: str,
                 budget: str | int | None = None, page_size: int | None = None,
                 backend: str = "host", config: str | os.PathLike[str] | None = None,
                 log: Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 launcher: Sequence[str] | None = None, new_session: bool = False,
                 timeout_s: float = START_TIMEOUT_S,
                 die_with_parent: bool = False) -> DaemonProcess:
    """Start a daemon on ``run_dir`` and return once it serves. If it does not, it is
    stopped and :class:`DaemonStartError` says why. ``die_with_parent``: see
    :func:`spawn_process`."""
    argv = daemon_argv(run_dir, *extra, budget=budget, page_size=page_size, backend=backend,
                       config=config, launcher=launcher)
    d = spawn(argv, run_dir, log, env, cwd, new_session, die_with_parent=die_with_parent)
    try:
        d.wait_serving(timeout_s)
    except BaseException:
        d.stop()
        raise
    return d


def restart(d: DaemonProcess, timeout_s: float = START_TIMEOUT_S) -> DaemonProcess:
    """The same command line again on the same run dir and log (appended), once ``d`` has
    exited (``d.kill()`` or ``d.stop()`` first). The dead daemon's socket files are removed
    first (it is reaped, nothing listens on them), so serving means the new daemon serves."""
    if d.popen.poll() is None:
        raise RuntimeError(f"daemon {d.pid} is still running")
    for path in (paths.control_path(d.run_dir), paths.pages_path(d.run_dir)):
        path.unlink(missing_ok=True)
    new = spawn(d.argv, d.run_dir, d.log, d.env, d.cwd, d.new_session, append=True)
    new.wait_serving(timeout_s)
    return new
