"""`kvpool serve --cpus` and `--pd --prefill-cpus/--decode-cpus` pin real server processes:
every thread of each process may run on exactly the CPUs asked (read from /proc), torch
reports one thread per CPU, a pinned pair still gives a single engine's greedy tokens,
and a bad CPU list is one clear line with a nonzero exit (no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import REPO
from kvpool.engine import cpus as pinning

from .test_pd_handoff import reference  # noqa: F401 (fixture)
from .test_pd_serve import body, healthy, serve

CPUS = sorted(os.sched_getaffinity(0))


def thread_cpus(pid: int) -> dict[int, str]:
    """tid -> Cpus_allowed_list of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(tid)] = line.split(":", 1)[1].strip()
    return out


def wait_for(log: Path, text: str, deadline_s: float = 60) -> str:
    end = time.monotonic() + deadline_s
    while text not in log.read_text() and time.monotonic() < end:
        time.sleep(0.2)
    return log.read_text()


def test_parse_and_format_cpu_lists():
    may = {0, 1, 2, 3, 5}
    assert pinning.parse("0-2,5", may) == [0, 1, 2, 5]
    assert pinning.parse(" 3 , 1", may) == [1, 3]
    assert pinning.format_list([0, 1, 2, 5]) == "0-2,5"
    for bad, says in (("4", "CPU 4 is not one"), ("x", "not a CPU list"),
                      ("2-1", "not a CPU range"), ("", "not a CPU list")):
        with pytest.raises(ValueError, match=says):
            pinning.parse(bad, may)


def test_serve_cpus_pins_every_thread_and_torch(tiny_dir, tmp_path):
    """A plain (not elastic) server, no daemon needed."""
    cpu = CPUS[-1]
    log = tmp_path / "serve.log"
    proc, url = serve(_NoDaemon(tmp_path), tiny_dir, log, "--cpus", str(cpu))
    try:
        healthy(proc, url, log)
        r = httpx.post(f"{url}/v1/completions", json=body(40), timeout=120)
        assert r.status_code == 200, r.text  # the step thread and torch's pool exist now
        got = thread_cpus(proc.pid)
        assert len(got) > 1 and set(got.values()) == {str(cpu)}, got
        assert f"pinned to CPUs {cpu} (1 torch thread)" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_a_pd_pair_gets_its_own_cpus_per_half(start_daemon, tiny_dir, reference, tmp_path):
    d = start_daemon(budget="8MiB")
    log = tmp_path / "pd.log"
    pre_cpu, dec_cpu = CPUS[0], CPUS[1]
    front, url = serve(d, tiny_dir, log, "--pd", "--served-model-name", "tiny",
                       "--prefill-cpus", str(pre_cpu), "--decode-cpus", str(dec_cpu))
    healthy(front, url, log)
    for n in (5, 130):
        r = httpx.post(f"{url}/v1/completions", json=body(n), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference[n], f"prompt of {n}"
    assert httpx.get(f"{url}/v1/stats", timeout=10).json()["pd"]["adopted"] == 2
    pids = {t["name"]: t["pid"] for t in d.cli_json("ps")["tenants"]}
    assert pids["tiny-decode"] == front.pid != pids["tiny-prefill"]
    for name, cpu in (("tiny-prefill", pre_cpu), ("tiny-decode", dec_cpu)):
        got = thread_cpus(pids[name])
        assert len(got) > 1 and set(got.values()) == {str(cpu)}, (name, got)
    text = wait_for(log, "(decode): pinned")
    assert f"kvpool serve (prefill): pinned to CPUs {pre_cpu} (1 torch thread)" in text
    assert f"kvpool serve --pd (decode): pinned to CPUs {dec_cpu} (1 torch thread)" in text
    front.terminate()
    front.wait(30)


@pytest.mark.parametrize("args, says", [
    (("--cpus", "99999"), "--cpus 99999: CPU 99999 is not one this process may use"),
    (("--cpus", "zero"), "--cpus zero: 'zero' is not a CPU list"),
    (("--cpus", "1-0"), "--cpus 1-0: '1-0' in '1-0' is not a CPU range"),
    (("--prefill-cpus", "0"), "--prefill-cpus/--decode-cpus need --pd"),
    (("--pd", "--prefill-cpus", "0", "--decode-cpus", "0,99999"),
     "--decode-cpus 0,99999: CPU 99999"),
])
def test_bad_cpus_are_one_clear_line(tiny_dir, args, says):
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "serve", str(tiny_dir),
                          *args], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {says}"), out.stderr
    assert "Traceback" not in out.stderr


class _NoDaemon:
    """What :func:`.test_pd_serve.serve` needs of a daemon, for a server without one."""

    def __init__(self, tmp: Path) -> None:
        self.run_dir = tmp / "no-daemon"
        self.workers: list[subprocess.Popen] = []
