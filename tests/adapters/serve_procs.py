"""Real ``kvpool serve`` subprocesses for the multi-tenant tests: start, wait, drive, kill."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpool import launch
from kvpool.demo.cluster import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (it runs in its own session)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 10 s (:func:`kvpool.launch.stop`)."""
        launch.stop(self.proc, 10.0, group=True)


def kill_all(servers: list[Server], wait_s: float) -> None:
    """SIGKILL every server's process group, then wait up to ``wait_s`` for each."""
    for s in servers:
        s.kill(signal.SIGKILL)
    for s in servers:
        try:
            s.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass


class Servers:
    """Starts servers and kills every one of them (process groups) in :meth:`close`."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.all: list[Server] = []

    def start(self, name: str, *, run_dir: Path | None = None, elastic: bool = True,
              idle_timeout: float = 1.0, extra: tuple[str, ...] = (),
              env: dict[str, str] | None = None, weights: str | None = "local",
              kv_cache_size: str = "4MiB") -> Server:
        """``weights``: KVPOOL_WEIGHTS of an elastic server; "local" by default, as the
        KV tests' budgets are sized for KV alone; None: the CLI's default (pool).
        ``kv_cache_size``: the KV's virtual capacity (elastic) or its size (static)."""
        port = free_port()
        log = self.log_dir / f"serve-{name}-{port}.log"
        extra_env = env or {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        if elastic:
            env.update(KVPOOL_RUN_DIR=str(run_dir), KVPOOL_IDLE_TIMEOUT=str(idle_timeout))
            if weights is not None:
                env.update(KVPOOL_WEIGHTS=weights)
        env.update(extra_env)  # e.g. KVPOOL_SHARES, KVPOOL_MIN
        cmd = launch.serve_argv(self.model, "--max-model-len", "512", *extra, port=port,
                                name=name, kv_cache_size=kv_cache_size,
                                elastic=elastic)
        proc = launch.spawn_process(cmd, log, cwd=REPO, new_session=True, base_env=env)
        s = Server(name, proc, port, log)
        self.all.append(s)
        return s

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Every server answers /health (:func:`kvpool.launch.wait_healthy`)."""
        deadline = time.monotonic() + timeout
        for s in self.all:
            launch.wait_healthy(s.proc, s.base, f"kvpool serve {s.name}", deadline, s.logs, 0.1)

    def close(self) -> None:
        kill_all(self.all, 10.0)


def prompt(seed: int, n: int = 64, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, vocab) for _ in range(n)]


def complete(base: str, ids: list[int], max_tokens: int, timeout: float = 60.0,
             **kw) -> httpx.Response:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **kw}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)
