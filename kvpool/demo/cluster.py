"""Starts and stops the processes of a demo run: a daemon (elastic mode) and one
``kvpool serve`` per model, each in its own process group so nothing outlives the run."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool import launch


class ClusterError(RuntimeError):
    """A process of the run failed to start or died; the message says which and why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str | None = None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Cluster:
    """``with Cluster(workdir) as c: c.daemon(...); c.serve(...)`` — every process is
    killed (SIGTERM, then SIGKILL) when the block ends, whatever happened inside."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    run_dir: Path | None = None

    def __enter__(self) -> Cluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        popen = launch.spawn_process(argv, log, env, new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def daemon(self, budget: int, page_size: int, extra: tuple[str, ...] = (),
               backend: str = "host") -> Proc:
        """A daemon on a fresh run dir (:func:`kvpool.launch.start_daemon`), serving when
        this returns; one that does not start raises :class:`ClusterError` with its log."""
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvpool-demo-", dir="/tmp"))
        log = self.workdir / "daemon.log"
        try:
            d = launch.start_daemon(self.run_dir, *extra, budget=budget, page_size=page_size,
                                    backend=backend, log=log, new_session=True)
        except launch.DaemonStartError as e:
            raise ClusterError(str(e)) from None
        proc = Proc("daemon", d.popen, log)
        self.procs.append(proc)
        return proc

    def serve(self, name: str, model_dir: Path, kv_cache_size: int, elastic: bool,
              extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
              weights: str = "local") -> Proc:
        """One ``kvpool serve``. Elastic servers keep their weights in the process by
        default (``weights="local"``), as static ones do, so a budget compares KV alone;
        ``weights="pool"`` puts them in the daemon's pool (the fleet demo)."""
        port = free_port()
        if elastic:
            extra = ("--weights", weights, *extra)
        argv = launch.serve_argv(model_dir, *extra, port=port, name=name,
                                 kv_cache_size=kv_cache_size, elastic=elastic)
        env = dict(env or {})
        if elastic:
            if self.run_dir is None:
                raise ClusterError("start the daemon before elastic servers")
            env |= {"KVPOOL_RUN_DIR": str(self.run_dir), "KVPOOL_TENANT": name}
        proc = self._spawn(f"serve-{name}", argv, env)
        proc.url = f"http://127.0.0.1:{port}"
        return proc

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              url: str | None = None) -> Proc:
        """Any other process of the run (``kvpool fleet``), stopped with the rest; one
        with a ``url`` is waited for by :meth:`wait_healthy` (``GET url/health``)."""
        proc = self._spawn(name, argv, env)
        proc.url = url
        return proc

    def serve_vllm(self, name: str, model_dir: Path, kv_cache_size: int, elastic: bool,
                   extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Proc:
        """A vLLM OpenAI server (``vllm serve``; the module form, which the CPU wheel needs).
        Static: ``--kv-cache-memory-bytes``; elastic: ``KVPOOL_ENABLE=1`` on this daemon.
        Both run vLLM's uniprocess executor, so the two modes differ only in KV memory."""
        port = free_port()
        args = ["--model", str(model_dir), "--served-model-name", name, "--host", "127.0.0.1",
                "--port", str(port), "--enforce-eager", "--disable-log-stats",
                "--uvicorn-log-level", "warning", *extra]
        env = {k: v for k, v in (env or {}).items()}
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false"}
        if elastic:
            if self.run_dir is None:
                raise ClusterError("start the daemon before elastic servers")
            env |= {"KVPOOL_ENABLE": "1", "KVPOOL_RUN_DIR": str(self.run_dir),
                    "KVPOOL_TENANT": name}
        else:
            args += ["--kv-cache-memory-bytes", str(kv_cache_size)]
        proc = self._spawn(f"vllm-{name}",
                           [*launch.module_argv("vllm.entrypoints.openai.api_server"), *args],
                           env)
        proc.url = f"http://127.0.0.1:{port}"
        return proc

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            if proc.url is not None:
                try:
                    launch.wait_healthy(proc.popen, proc.url, proc.name, deadline, proc.tail)
                except launch.ChildStartError as e:
                    raise ClusterError(str(e)) from None

    def _check(self, proc: Proc) -> None:
        if proc.popen.poll() is not None:
            raise ClusterError(f"{proc.name} exited with code {proc.popen.returncode}:\n"
                               f"{proc.tail()}")

    def check_alive(self) -> None:
        for proc in self.procs:
            self._check(proc)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # servers first, the daemon last
            launch.stop(proc.popen, grace_s=5.0, group=True)
        self.procs.clear()
        if self.run_dir is not None:
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
