"""A real daemon with ``huge_pages = true`` and real tenants: pages change hands between
processes over hugetlb memory, another tenant's pages read zeros, an exhausted huge
page pool refuses a grant with NO_MEMORY (nobody gets SIGBUS, the daemon keeps
serving), and a configuration that cannot work is refused at start with one line.

Needs free huge pages: the ``huge`` fixture uses those free, or (as root) raises
``vm.nr_hugepages`` for the test and restores it, or skips saying why.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.client_lib import NoMemory, handoff
from kvpool.daemon.config import Config, ConfigError
from kvpool.vmm import hugetlb
from kvpool.vmm.hugetlb import free_pages as free_huge  # neither in use nor reserved
from vmm.fixtures import borrowed_huge_pages

from .handoff_worker import fill, pattern, read
from .helpers import REPO, daemon_command, read_event

HUGE = hugetlb.huge_page_size() or 2 << 20
PAGE = HUGE
POOL = 12  # huge pages the tests need free
WORKER = Path(__file__).with_name("handoff_worker.py")


huge = borrowed_huge_pages(POOL * HUGE)


def toml(tmp_path: Path, text: str = "huge_pages = true\n") -> str:
    path = tmp_path / "kvpool.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture
def hugeon(huge, start_daemon, tmp_path):
    """A daemon on hugetlb pages of one huge page each, budget 8 pages, no warm pool."""
    return start_daemon(budget=str(8 * PAGE), page_size=PAGE,
                        extra=("--config", toml(tmp_path), "--warm-max", "0"))


class Hog:
    """Huge pages taken from the pool by this test process (reserved memfds)."""

    def __init__(self):
        self.fds: list[int] = []

    def take(self) -> None:
        fd = hugetlb.create_fd("hog", os.MFD_CLOEXEC)
        self.fds.append(fd)
        os.ftruncate(fd, HUGE)
        hugetlb.reserve(fd, HUGE, "hog")

    def take_all(self) -> None:
        while free_huge():
            self.take()

    def give_back(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def test_a_handoff_over_huge_pages_keeps_the_bytes_and_the_giver_loses_them(hugeon):
    d = hugeon
    cmd = [sys.executable, str(WORKER), "give", "--units", "3", "--offer", "1,2",
           "--capacity", str(4 * PAGE), "--touch-after", "--run-dir", str(d.run_dir)]
    giver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    d.workers.append(giver)
    tid = read_event(giver, "ticket")["ticket"]
    with d.connect("decode") as receiver:
        rg = receiver.region_group(2, 4 * PAGE)
        assert rg.page_size == PAGE
        assert all(base % HUGE == 0 for base in rg.bases)  # hugetlb needs aligned slots
        assert handoff.claim(rg, tid, [0, 3]) == [0, 3]
        for at, src in ((0, 1), (3, 2)):
            for r in range(2):
                assert read(rg, at, r) == pattern(src, r, PAGE)
        assert read_event(giver, "settled")["state"] == "claimed"
        assert read_event(giver, "kept")["ok"] is True
        read_event(giver, "touching")
        assert giver.wait(30) == -signal.SIGSEGV  # its mapping of a given page is gone
        rg.release([0, 3])
    assert d.check() == []


def test_another_tenants_pages_read_zeros(hugeon):
    d = hugeon
    with d.connect("first") as a:
        g = a.region_group(1, 8 * PAGE)
        g.grant(range(4))
        fill(g, range(4))
        g.release(range(4))
    with d.connect("second") as b:
        g = b.region_group(1, 8 * PAGE)
        g.grant(range(4))  # the first's pages retired, fresh ones in their place
        for u in range(4):
            assert read(g, u) == bytes(PAGE), f"unit {u} holds another tenant's bytes"
        g.release(range(4))
    assert d.check() == []


def test_an_exhausted_pool_refuses_the_grant_and_nobody_gets_sigbus(hugeon):
    d = hugeon
    hog = Hog()
    try:
        with d.connect("t") as t:
            g = t.region_group(1, 8 * PAGE)
            g.grant([0])
            ctypes.memset(g.unit_address(0, 0), 1, PAGE)
            hog.take_all()  # someone else took every free huge page
            with pytest.raises(NoMemory, match="huge pages"):
                g.grant([1, 2])
            assert g.mapped == {0} and read(g, 0)[:3] == b"\x01\x01\x01"
            assert d.proc.poll() is None and d.check() == []
            hog.give_back()
            g.grant([1, 2])  # the pool has pages again: served
            ctypes.memset(g.unit_address(0, 1), 2, 2 * PAGE)
            g.release([0, 1, 2])
    finally:
        hog.give_back()
    assert d.check() == []


def refused(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert len(lines) == 1 and lines[0].startswith("Error: configuration: "), out.stderr
    return lines[0]


def test_a_page_size_not_a_multiple_of_the_huge_page_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"huge_pages": True, "page_size": HUGE // 2})
    assert len(e.value.problems) == 1 and "multiple of the huge page size" in str(e.value)
    line = refused(daemon_command(tmp_path / "run", "--config", toml(tmp_path),
                                  budget="8MiB", page_size=64 << 10))
    assert "not a multiple of the huge page size" in line
    assert not (tmp_path / "run" / "control.sock").exists()


def test_too_few_free_huge_pages_for_the_warm_pool_is_refused(huge, tmp_path):
    hog = Hog()
    try:
        hog.take()  # one huge page in use elsewhere
        cfg = toml(tmp_path, 'huge_pages = true\nwarm_min = "100%"\n')
        line = refused(daemon_command(tmp_path / "run", "--config", cfg, budget="100%",
                                      page_size=PAGE))
        assert "pre-create" in line and "HugePages_Free" in line
    finally:
        hog.give_back()


def test_no_huge_pages_at_all_is_refused(tmp_path):
    if hugetlb.meminfo().get("HugePages_Total", 0):
        pytest.skip("huge pages are reserved on this machine")
    line = refused(daemon_command(tmp_path / "run", "--config", toml(tmp_path),
                                  budget="8MiB", page_size=PAGE))
    assert "nr_hugepages" in line and "less than one" in line


def test_huge_pages_with_the_cuda_backend_is_refused():
    with pytest.raises(ConfigError, match="host pages only"):
        Config.from_dict({"huge_pages": True, "backend": "cuda"})


def test_a_restarted_daemon_adopts_the_tenants_huge_pages(hugeon):
    """SIGKILL the daemon while a tenant process maps 4 hugetlb pages: the next daemon
    (same config) starts although no huge page is free then, and adopts them."""
    from .helpers import respawn

    d = hugeon
    holder = d.worker("hold", "--name", "h0", "--units", "4", "--regions", "1",
                      "--capacity", str(4 * PAGE))
    assert read_event(holder, "ready")["pages"] == 4
    d.proc.kill()
    d.proc.wait(30)
    hog = Hog()
    try:
        hog.take_all()
        respawn(d)
    finally:
        hog.give_back()
    deadline = time.monotonic() + 30
    while True:
        try:
            after = {t.name: t.mapped for t in d.stats().tenants}
        except Exception:  # noqa: BLE001 - the new daemon may not answer yet
            after = {}
        if after == {"h0": 4 * PAGE}:
            break
        assert time.monotonic() < deadline, (after, d.logs()[-2000:])
        time.sleep(0.1)
    assert holder.poll() is None and d.check() == []
