"""A fleet's life under hostile conditions, with real fleets, daemons and members
(issue 33 items 9 and 11, issue 34 item 2):

* a member that stops answering (SIGSTOP: the kernel still accepts its connections) is
  shown ``hung``, gets no request (another replica serves; a model with none left is a
  503 with one line), comes back if it answers again, and is killed and started again
  if it stays silent;
* a fleet killed with SIGKILL takes its daemon and members with it, and the next
  ``--with-daemon`` start removes the run directory it left;
* started from a folder holding a folder named ``kvpool`` (the folder holding a
  clone), the fleet's and the demo's children import the package, not that folder;
* a fleet whose daemon does not start leaves no run directory.

Outcomes are waited for with generous deadlines, never timed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from kvpool import launch
from kvpool.fleet.member import free_port

from daemon.helpers import PAGE, wait_for

from .prom import metric

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 180.0
PROMPT = [17, 301, 44, 5, 230, 99, 12, 480]
#: this interpreter, the current directory off the path, whatever the code under test does
TOP = [sys.executable, "-P", "-m", "kvpool.cli.main"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvpool.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("life-models")
    return {n: make_tiny_model(d / n, layers=2, hidden=128, heads=4, kv_heads=2, vocab=512,
                               seed=i + 1) for i, n in enumerate(("m", "solo"))}


def fleet_file(path: Path, port: int, entries: list[str], fleet: str = "",
               budget: str = f"{200 * PAGE // 1024}KiB") -> Path:
    text = (f'[fleet]\nname = "life"\nport = {port}\nstart_timeout_s = 150\n{fleet}'
            f'[daemon]\nbudget = "{budget}"\npage_size = "{PAGE // 1024}KiB"\n')
    path.write_text(text + "".join(entries))
    return path


def entry(name: str, checkpoint: Path, eager: bool, replicas: int = 1) -> str:
    return (f'[[models]]\nname = "{name}"\ncheckpoint = "{checkpoint}"\nreplicas = {replicas}\n'
            f'kv_cache_size = "2MiB"\nmax_num_seqs = 4\nargs = ["--max-model-len", "256"]\n'
            f'eager = {"true" if eager else "false"}\n')


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_healthy(self) -> None:
        launch.wait_healthy(self.proc, self.url, "kvpool fleet",
                            time.monotonic() + DEADLINE_S, self.logs)

    def run_dir(self) -> Path:
        found = re.search(r"started a daemon on run dir (\S+)", self.logs())
        assert found, self.logs()
        return Path(found.group(1))

    def replicas(self, model: str) -> list[dict]:
        data = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"]
        return next(m for m in data if m["id"] == model)["replicas"]

    def ps(self) -> dict[str, dict]:
        out = subprocess.run([*TOP, "ps", "--json", "--run-dir", str(self.run_dir())],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out
        return {t["name"]: t for t in json.loads(out.stdout)["tenants"]}

    def complete(self, model: str) -> httpx.Response:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=DEADLINE_S)

    def stop(self) -> int:
        """SIGTERM to the fleet alone (it stops the rest); its group killed after."""
        code = launch.stop(self.proc, 60.0)
        launch.stop(self.proc, 10.0, group=True)
        return code


def start(toml: Path, port: int, log_dir: Path, cwd: Path = REPO) -> Fleet:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    argv = [*TOP, "fleet", str(toml), "--with-daemon", "--log-dir", str(log_dir)]
    log = log_dir.parent / f"{toml.stem}.log"
    proc = launch.spawn_process(argv, log, cwd=cwd, new_session=True, base_env=env)
    return Fleet(proc, f"http://127.0.0.1:{port}", log)


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_hung_member_gets_no_requests_and_is_restarted(models, tmp_path) -> None:
    """Replica 0 of ``m`` and ``solo`` SIGSTOPped: both shown ``hung``; ``m`` is served
    by replica 1, ``solo`` is a 503 with one line; ``solo`` let go (SIGCONT) answers
    again and serves; ``m``'s replica 0, silent on, is killed and started again."""
    port = free_port()
    toml = fleet_file(tmp_path / "hung.toml", port,
                      [entry("m", models["m"], True, replicas=2),
                       entry("solo", models["solo"], True)],
                      fleet="hung_after_s = 15\nhung_restart_s = 90\n")
    fl = start(toml, port, tmp_path / "logs")
    stopped: list[int] = []
    try:
        fl.wait_healthy()
        wait_for(lambda: all(r["state"] == "awake" for n in ("m", "solo")
                             for r in fl.replicas(n)), DEADLINE_S, 0.5, "every member up")
        ps = fl.ps()
        m0, solo = ps["m"]["pid"], ps["solo"]["pid"]
        for pid in (m0, solo):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        wait_for(lambda: fl.replicas("m")[0]["state"] == "hung"
                 and fl.replicas("solo")[0]["state"] == "hung", DEADLINE_S, 0.5,
                 "both shown hung")
        assert fl.replicas("m")[1]["state"] == "awake"
        health = httpx.get(f"{fl.url}/health", timeout=30).json()
        assert health["models"] == {"m": "awake", "solo": "hung"}, health
        for _ in range(3):  # never sent to the hung replica
            r = fl.complete("m")
            assert r.status_code == 200, r.text
        text = httpx.get(f"{fl.url}/metrics", timeout=30).text
        assert metric(text, "kvpool_fleet_requests_total", model="m", replica="1",
                      code="200") == 3, text
        assert metric(text, "kvpool_fleet_replica_up", model="solo", replica="0",
                      state="hung") == 1, text
        r = fl.complete("solo")
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
        message = r.json()["error"]["message"]
        assert "hung" in message and "\n" not in message, message
        # solo answers again: awake, same process, serves
        os.kill(solo, signal.SIGCONT)
        stopped.remove(solo)
        wait_for(lambda: fl.replicas("solo")[0]["state"] == "awake", DEADLINE_S, 0.5,
                 "solo awake again")
        assert fl.complete("solo").status_code == 200
        assert fl.ps()["solo"]["pid"] == solo
        # m's replica 0 stays silent: killed, started again, serves
        wait_for(lambda: "m answered nothing" in fl.logs() and "killed it" in fl.logs(),
                 DEADLINE_S, 0.5, "the hung member killed")
        wait_for(lambda: fl.replicas("m")[0]["state"] == "awake", DEADLINE_S, 0.5,
                 "replica 0 up again")
        assert not psutil.pid_exists(m0) or gone(psutil.Process(m0))
        stopped.remove(m0)
        assert fl.ps()["m"]["pid"] != m0
        text = httpx.get(f"{fl.url}/metrics", timeout=30).text
        assert metric(text, "kvpool_fleet_restarts_total", model="m") == 1, text
        assert metric(text, "kvpool_fleet_restarts_total", model="solo") == 0, text
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = fl.stop()
    assert code == 0, fl.logs()
    assert "Traceback" not in fl.logs()


def test_a_sigkilled_fleet_takes_its_daemon_and_members_with_it(models, tmp_path) -> None:
    """SIGKILL to the fleet alone (its members and daemon are in sessions of their own):
    every process it started exits (their memory with them), and the next
    ``--with-daemon`` start removes the run directory it left."""
    port = free_port()
    toml = fleet_file(tmp_path / "killed.toml", port, [entry("m", models["m"], True)])
    fl = start(toml, port, tmp_path / "logs")
    children: list[psutil.Process] = []
    try:
        fl.wait_healthy()
        wait_for(lambda: fl.replicas("m")[0]["state"] == "awake", DEADLINE_S, 0.5, "m up")
        run_dir = fl.run_dir()
        assert fl.complete("m").status_code == 200  # it holds KV memory now
        children = psutil.Process(fl.proc.pid).children(recursive=True)
        pids = {p.pid for p in children}
        assert fl.ps()["m"]["pid"] in pids and len(children) >= 2, children  # daemon too
        os.kill(fl.proc.pid, signal.SIGKILL)
        fl.proc.wait()
        wait_for(lambda: all(gone(p) for p in children), DEADLINE_S, 0.2,
                 "every process the fleet started exiting")
    finally:
        fl.stop()
        for p in children:  # (a failed run: do not leak them into other tests)
            if not gone(p):
                p.kill()
    assert run_dir.exists()  # (nothing could remove it yet)
    # the next fleet started with its own daemon removes it
    port2 = free_port()
    toml2 = fleet_file(tmp_path / "next.toml", port2, [entry("m", models["m"], False)])
    nxt = start(toml2, port2, tmp_path / "logs2")
    try:
        nxt.wait_healthy()
        assert not run_dir.exists(), nxt.logs()
        assert f"removed {run_dir}" in nxt.logs()
    finally:
        code = nxt.stop()
    assert code == 0, nxt.logs()


def shadowing_folder(root: Path) -> Path:
    """``root`` holding ``kvpool/``: a clone's layout (``kvpool/kvpool/__init__.py``
    without ``__version__``, ``pyproject.toml``) whose top also holds an
    ``__init__.py`` that fails. (A clone's folder alone shadows only a package found by
    a finder after the path's, as an editable install's is; PYTHONPATH, as the tests
    run, would win over it. With the ``__init__.py`` it shadows however the package is
    installed, so the test holds everywhere.)"""
    clone = root / "kvpool"
    (clone / "kvpool").mkdir(parents=True)
    (clone / "pyproject.toml").write_text('[project]\nname = "kvpool"\n')
    (clone / "kvpool" / "__init__.py").write_text("")
    (clone / "__init__.py").write_text(
        "raise ImportError('the folder holding the clone was imported as kvpool')\n")
    return root


def test_the_folder_holding_the_clone_does_not_shadow_the_package(models, tmp_path) -> None:
    """``kvpool fleet --with-daemon`` (daemon and a member started on a request) and a
    short ``kvpool demo`` run from a folder holding a folder named ``kvpool``."""
    here = shadowing_folder(tmp_path / "home")
    port = free_port()
    toml = fleet_file(tmp_path / "shadow.toml", port, [entry("m", models["m"], False)])
    fl = start(toml, port, tmp_path / "logs", cwd=here)
    try:
        fl.wait_healthy()
        r = fl.complete("m")
        assert r.status_code == 200, (r.text, fl.logs())
        run_dir = fl.run_dir()
    finally:
        code = fl.stop()
    assert code == 0, fl.logs()
    assert not run_dir.exists()
    out = tmp_path / "demo"
    demo = subprocess.run(
        [*TOP, "demo", "--scenario", "kv", "--out", str(out), "--duration", "2",
         "--peak-rate", "2", "--base-rate", "0.5", "--no-live"], cwd=here,
        capture_output=True, text=True, timeout=400)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert (out / "results.json").exists()


def test_a_fleet_whose_daemon_does_not_start_leaves_no_run_dir(models, tmp_path) -> None:
    """A budget the daemon refuses (more than the host has): one line, exit 1, and no
    ``/tmp/kvpool-fleet-PID-*`` left behind."""
    port = free_port()
    toml = fleet_file(tmp_path / "nodaemon.toml", port, [entry("m", models["m"], False)],
                      budget="100TiB")
    fl = start(toml, port, tmp_path / "logs")
    code = fl.proc.wait(DEADLINE_S)
    lines = [x for x in fl.logs().splitlines()  # (what it swept is said on its own line)
             if x.strip() and not x.startswith("fleet: removed /tmp/kvpool-fleet-")]
    assert code == 1 and len(lines) == 1, fl.logs()
    assert "daemon did not start" in lines[0], lines
    assert not list(Path("/tmp").glob(f"kvpool-fleet-{fl.proc.pid}-*"))
