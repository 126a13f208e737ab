"""Real vLLM (CPU build) OpenAI servers and kvpool daemons for the vLLM adapter tests.

Each server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve``
script of the CPU wheel cannot start) in its own session, so a test can signal the whole
process tree; :class:`VllmServers` kills every one it started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpool import launch
from kvpool.demo.cluster import free_port

from .serve_procs import Server, kill_all

REPO = Path(__file__).resolve().parents[2]
VLLM_ARGS = ("--enforce-eager", "--max-model-len", "512", "--dtype", "float32",
             "--max-num-seqs", "8", "--enable-prompt-tokens-details")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@dataclass
class Daemon:
    run_dir: Path
    proc: subprocess.Popen
    log: Path
    args: tuple = ()

    def ps(self) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "ps", "--json",
                              "--run-dir", str(self.run_dir)], capture_output=True, text=True,
                             timeout=30, cwd=REPO)
        data = json.loads(out.stdout)
        return data["tenants"] if isinstance(data, dict) else data

    def tenant(self, name: str) -> dict | None:
        return next((t for t in self.ps() if t["name"] == name), None)

    def stop(self) -> None:
        launch.stop(self.proc, 15.0)  # SIGTERM, SIGKILL after 15 s


def start_daemon(budget: str = "4MiB", page_size: int = 65536, run_dir: Path | None = None,
                 extra: tuple[str, ...] = ()) -> Daemon:
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvp-vllm-", dir="/tmp"))
    log = run_dir.with_suffix(".log")
    args = ("daemon", "--backend", "host", "--run-dir", str(run_dir), "--budget", budget,
            "--page-size", str(page_size), *extra)
    with open(log, "a") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli.main", *args], stdout=f,
                                stderr=subprocess.STDOUT, cwd=REPO)
    d = Daemon(run_dir, proc, log, args)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited:\n{log.read_text()}")
        try:
            d.ps()
            return d
        except Exception:
            time.sleep(0.2)
    raise AssertionError(f"daemon not ready:\n{log.read_text()}")


def restart_daemon(d: Daemon) -> Daemon:
    """Crash the daemon (SIGKILL: its restart state stays) and start a new one in its place;
    the tenants reconnect and adopt what they map."""
    d.proc.kill()
    d.proc.wait()
    return start_daemon(d.args[d.args.index("--budget") + 1],
                        int(d.args[d.args.index("--page-size") + 1]), d.run_dir)


def remove_daemon(d: Daemon) -> None:
    d.stop()
    shutil.rmtree(d.run_dir, ignore_errors=True)
    d.log.unlink(missing_ok=True)


@dataclass
class VllmServer(Server):
    """A vLLM server in its own session (``base``, ``logs``, ``kill`` as for
    ``kvpool serve``) and the environment it was started with."""

    env: dict = field(default_factory=dict)

    def engine_pids(self) -> list[int]:
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def server_cmd(model: Path, name: str, port: int, extra: tuple = ()) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
            *VLLM_ARGS, *extra]


def base_env(run_dir: Path | None, cpu: int | None = None, **extra: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "VLLM_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if run_dir is not None:
        env.update(KVPOOL_ENABLE="1", KVPOOL_RUN_DIR=str(run_dir), KVPOOL_IDLE_TIMEOUT="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE")
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    for k, v in extra.items():  # None removes a variable
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


class VllmServers:
    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.all: list[VllmServer] = []

    def start(self, name: str, run_dir: Path | None, extra: tuple = (), cpu: int | None = None,
              port: int | None = None, **env: str | None) -> VllmServer:
        port = port or free_port()
        log = self.log_dir / f"vllm-{name}-{port}.log"
        e = base_env(run_dir, cpu, **env)
        with open(log, "w") as f:
            proc = subprocess.Popen(server_cmd(self.model, name, port, extra), stdout=f,
                                    stderr=subprocess.STDOUT, cwd=REPO, env=e,
                                    start_new_session=True)
        s = VllmServer(name, proc, port, log, e)
        self.all.append(s)
        return s

    def wait_healthy(self, *servers: VllmServer, timeout: float = 400.0) -> None:
        deadline = time.monotonic() + timeout
        for s in servers or self.all:
            while True:
                if s.proc.poll() is not None:
                    raise AssertionError(f"vLLM {s.name} exited ({s.proc.returncode}):\n"
                                         f"{s.logs()[-4000:]}")
                try:
                    if httpx.get(f"{s.base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"vLLM {s.name} not healthy:\n{s.logs()[-4000:]}")
                time.sleep(0.5)

    def close(self) -> None:
        kill_all(self.all, 15.0)


def run_fails(cmd: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a server that must refuse to start; returns the finished process."""
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


PROMPTS = [f"Question {i}: what is the weather like in the town by the river? Answer:"
           for i in range(8)]


def complete(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One greedy completion through the OpenAI client; the response as a dict."""
    from openai import OpenAI

    c = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
    r = c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.model_dump()
