"""The CUDA backend on a real GPU: the host-backend scenarios, plus device faults.

Every test is marked ``gpu`` and skipped unless ``kvpool.vmm.cuda.probe()`` finds a
device with VMM and POSIX-fd handle support. Other processes are real interpreters
started with ``subprocess`` (never ``fork`` after CUDA is initialized); page fds travel
over a ``SOCK_SEQPACKET`` socketpair with :mod:`kvpool.fdchannel`.

``mem_info`` is device-wide, so memory checks compare deltas measured with nothing
else allocating in between, with a tolerance for driver bookkeeping.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvpool.vmm.base import InvalidArgument
from kvpool.vmm.cuda import probe

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
TOL = 32 * MiB  # slack for page tables and other driver bookkeeping

_REASON = probe()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"no usable CUDA device: {_REASON}"),
]


@pytest.fixture(scope="module")
def backend():
    from kvpool.vmm.cuda import CudaBackend

    b = CudaBackend(device=0)
    yield b
    b.close()


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA support in this environment")
    torch.cuda.init()
    return torch


def view(backend, rng, dtype=None, **kw):
    import torch

    from kvpool.client_lib.tensors import tensor_view

    return tensor_view(backend, rng, dtype or torch.uint8, **kw)


CHILD_PRELUDE = """
import ctypes, json, os, socket, sys
from kvpool import fdchannel
from kvpool.vmm.cuda import CudaBackend
MiB = 1 << 20
sock = socket.socket(fileno=int(sys.argv[1]))
def say(obj):
    fdchannel.send_fds(sock, json.dumps(obj).encode(), [])
def hear():
    data, fds = fdchannel.recv_fds(sock)
    return json.loads(data.decode() or "null"), fds
"""


class Child:
    """A fresh Python process connected to us by a SOCK_SEQPACKET socketpair."""

    def __init__(self, code: str):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        theirs.close()
        self.sock.settimeout(120)

    def send(self, obj, fds=()):
        from kvpool import fdchannel

        fdchannel.send_fds(self.sock, json.dumps(obj).encode(), list(fds))

    def recv(self):
        from kvpool import fdchannel

        try:
            data, fds = fdchannel.recv_fds(self.sock)
        except OSError:  # timed out: do not leave the child behind
            self.proc.kill()
            raise
        if not data:
            out, err = self.proc.communicate(timeout=60)
            raise AssertionError(f"child hung up (rc={self.proc.returncode}):\n{out}\n{err}")
        return json.loads(data.decode())

    def finish(self, timeout=120) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.sock.close()
        return self.proc.returncode, out, err


def test_granularity_and_identity(backend, torch_cuda):
    assert backend.min_page_size() == 2 * MiB, backend.min_page_size()
    assert backend.page_size == backend.min_page_size()
    uuid = backend.device_uuid()
    assert uuid.startswith("GPU-") and len(uuid) == 40
    props = torch_cuda.cuda.get_device_properties(0)
    theirs = "".join(c for c in str(getattr(props, "uuid", "")).lower().replace("gpu-", "")
                     if c in "0123456789abcdef")
    if len(theirs) == 32:  # torch's spelling varies across versions; compare the digits
        assert theirs == uuid[4:].replace("-", ""), (theirs, uuid)
    free, total = backend.mem_info()
    assert 0 < free <= total


def test_reserve_64gib_costs_no_device_memory(backend):
    free0, _ = backend.mem_info()
    rng = backend.reserve(64 * GiB)
    free1, _ = backend.mem_info()
    assert abs(free0 - free1) < TOL, (free0, free1)
    assert rng.base % backend.page_size == 0
    backend.free_range(rng)


def test_map_write_read_through_torch(backend, torch_cuda):
    torch = torch_cuda
    rng = backend.reserve(64 * MiB)
    pages = [backend.create_page() for _ in range(4)]
    for p in pages:
        backend.zero(p)
    backend.map_pages(rng, 8 * MiB, pages)
    for p in pages:
        backend.release(p)  # the mappings keep the memory alive
    t = view(backend, rng, torch.float32, offset=8 * MiB, nbytes=8 * MiB)
    assert t.device.type == "cuda" and t.data_ptr() == rng.base + 8 * MiB
    assert int(t.count_nonzero()) == 0
    t.copy_(torch.arange(t.numel(), device=t.device, dtype=torch.float32))
    torch.cuda.synchronize()
    # a second view at a different offset aliases the same memory
    u = view(backend, rng, torch.float32, offset=10 * MiB, shape=(16,))
    first = (2 * MiB) // 4
    assert u.cpu().tolist() == [float(first + i) for i in range(16)]
    bf = view(backend, rng, torch.bfloat16, offset=14 * MiB, shape=(2, 8))
    bf.fill_(1.5)
    torch.cuda.synchronize()
    assert bf.float().sum().item() == 24.0
    del t, u, bf
    backend.unmap(rng, 8 * MiB, 4)
    assert rng.mapped == {}
    backend.free_range(rng)


def test_zero_zeroes(backend, torch_cuda):
    torch = torch_cuda
    rng = backend.reserve(4 * MiB)
    p = backend.create_page()
    backend.map(rng, 2 * MiB, p)
    t = view(backend, rng, offset=2 * MiB, nbytes=2 * MiB)
    t.fill_(0xAB)
    torch.cuda.synchronize()
    backend.zero(p)  # through the backend's private scratch mapping and stream
    assert int(t.count_nonzero()) == 0
    t.fill_(7)
    torch.cuda.synchronize()
    backend.zero(p)
    assert int(t.count_nonzero()) == 0
    del t
    backend.unmap(rng, 2 * MiB)
    backend.release(p)
    backend.free_range(rng)


IMPORTER = """
b = CudaBackend()
import torch
from kvpool.client_lib.tensors import tensor_view
msg, fds = hear()
page = b.import_(fds[0])
os.close(fds[0])           # an open fd would pin the memory
rng = b.reserve(4 * MiB)
b.map(rng, 2 * MiB, page)
b.release(page)
t = tensor_view(b, rng, torch.uint8, offset=2 * MiB, nbytes=2 * MiB)
head = t[:8].cpu().tolist()
total = int(t.to(torch.int64).sum())
t[8:16].fill_(0x43)        # write back for the parent to see
torch.cuda.synchronize()
say({"head": head, "sum": total})
hear()                     # wait until the parent has looked
del t
b.unmap(rng, 2 * MiB)
b.free_range(rng)
b.close()
"""


def test_export_import_across_processes(backend, torch_cuda):
    torch = torch_cuda
    rng = backend.reserve(2 * MiB)
    p = backend.create_page()
    backend.map(rng, 0, p)
    t = view(backend, rng)
    t.fill_(0x42)
    torch.cuda.synchronize()
    child = Child(IMPORTER)
    fd = backend.export(p)
    assert isinstance(fd, int) and fd >= 0
    child.send("page", [fd])
    os.close(fd)
    reply = child.recv()
    assert reply["head"] == [0x42] * 8
    assert reply["sum"] == 0x42 * (2 * MiB - 8) + 0x43 * 8
    assert t[:16].cpu().tolist() == [0x42] * 8 + [0x43] * 8
    child.send("done")
    rc, out, err = child.finish()
    assert rc == 0, err
    del t
    backend.unmap(rng, 0)
    backend.release(p)
    backend.free_range(rng)


HOLDER = """
b = CudaBackend()
say({"free": b.mem_info()[0]})                 # parent still holds the pages
msg, fds = hear()
pages = [b.import_(fd) for fd in fds]
for fd in fds:
    os.close(fd)
rng = b.reserve(len(pages) * 2 * MiB)
b.map_pages(rng, 0, pages)
for p in pages:
    b.release(p)
say({"mapped": len(pages)})
hear()                                         # parent unmapped and released
held = b.mem_info()[0]
b.unmap(rng, 0, len(pages))
freed = b.mem_info()[0]
b.free_range(rng)
say({"held": held, "freed": freed})
b.close()
"""


def test_memory_returns_only_after_every_process_lets_go(backend):
    n = 128  # 256 MiB: far above the measurement tolerance
    free0, _ = backend.mem_info()
    pages = [backend.create_page() for _ in range(n)]
    rng = backend.reserve(n * backend.page_size)
    backend.map_pages(rng, 0, pages)
    free1, _ = backend.mem_info()
    assert free0 - free1 >= n * backend.page_size - TOL, (free0, free1)

    child = Child(HOLDER)
    child_free0 = child.recv()["free"]
    fds = [backend.export(p) for p in pages]
    child.send("pages", fds)
    for fd in fds:
        os.close(fd)
    assert child.recv()["mapped"] == n
    backend.unmap(rng, 0, n)
    for p in pages:
        backend.release(p)
    child.send("released")
    r = child.recv()
    size = n * backend.page_size
    # the child's mappings still hold the memory after the parent let go ...
    assert abs(r["held"] - child_free0) < TOL, (r, child_free0)
    # ... and it comes back when the child unmaps
    assert r["freed"] - r["held"] >= size - TOL, r
    rc, out, err = child.finish()
    assert rc == 0, err
    deadline = time.monotonic() + 10  # the child's context goes away as it exits
    while True:
        free2, _ = backend.mem_info()
        if abs(free2 - free0) < TOL or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert abs(free2 - free0) < TOL, (free0, free2)
    backend.free_range(rng)


def test_release_without_mapping_returns_memory(backend):
    free0, _ = backend.mem_info()
    pages = [backend.create_page() for _ in range(64)]
    assert free0 - backend.mem_info()[0] >= 128 * MiB - TOL
    for p in pages:
        backend.release(p)
    assert abs(backend.mem_info()[0] - free0) < TOL


def test_bad_arguments_raise_typed_errors_and_backend_stays_usable(backend, torch_cuda):
    torch = torch_cuda
    ps = backend.page_size
    rng = backend.reserve(4 * ps)
    p = backend.create_page()
    with pytest.raises(InvalidArgument):
        backend.reserve(ps + 4096)
    with pytest.raises(InvalidArgument):
        backend.reserve(0)
    with pytest.raises(InvalidArgument):
        backend.map(rng, ps // 2, p)  # unaligned offset
    with pytest.raises(InvalidArgument):
        backend.map(rng, 4 * ps, p)  # outside the range
    with pytest.raises(InvalidArgument):
        backend.map_pages(rng, 3 * ps, [p, p])  # runs past the end
    backend.map(rng, 0, p)
    with pytest.raises(InvalidArgument):
        backend.map(rng, 0, p)  # over a mapped page
    with pytest.raises(InvalidArgument):
        backend.unmap(rng, ps)  # never mapped
    backend.unmap(rng, 0)
    with pytest.raises(InvalidArgument):
        backend.unmap(rng, 0)  # double unmap
    fd = backend.export(p)
    backend.release(p)
    with pytest.raises(InvalidArgument):
        backend.release(p)  # double release
    with pytest.raises(InvalidArgument):
        backend.export(p)
    os.close(fd)
    with pytest.raises(InvalidArgument):
        backend.import_(fd)  # closed fd
    # still fully usable
    good = backend.create_page()
    backend.map(rng, 0, good)
    backend.release(good)
    t = view(backend, rng, nbytes=ps)
    t.fill_(9)
    torch.cuda.synchronize()
    assert int(t[-1]) == 9
    del t
    backend.free_range(rng)  # unmaps what is still mapped
    with pytest.raises(InvalidArgument):
        backend.free_range(rng)


def test_retain_handle_reexports_a_mapped_page(backend, torch_cuda):
    torch = torch_cuda
    rng = backend.reserve(2 * MiB)
    p = backend.create_page()
    backend.map(rng, 0, p)
    backend.release(p)  # only the mapping holds the memory now
    again = backend.retain_handle(rng.base)
    fd = backend.export(again)
    imported = backend.import_(fd)
    os.close(fd)
    r2 = backend.reserve(2 * MiB)
    backend.map(r2, 0, imported)
    a, b = view(backend, rng, nbytes=64), view(backend, r2, nbytes=64)
    a.fill_(0x11)
    torch.cuda.synchronize()
    assert b.cpu().tolist() == [0x11] * 64
    del a, b
    for pg in (again, imported):
        backend.release(pg)
    backend.free_range(r2)
    backend.free_range(rng)


REJECTER = """
from kvpool.vmm.base import Page, Range, VmmError
b = CudaBackend()
ps = b.page_size
rng = b.reserve(4 * ps)
res = {}
bogus = Page(handle=0xDEAD0000, size=ps)
try:
    b.map(rng, 0, bogus)
    res["map"] = "no error"
except VmmError as e:
    res["map"] = [type(e).__name__, str(e)]
res["map_left"] = len(rng.mapped)
try:
    b.release(Page(handle=0xDEAD0000, size=ps))
    res["release"] = "no error"
except VmmError as e:
    res["release"] = [type(e).__name__, str(e)]
good = b.create_page()
try:
    b.map_pages(rng, 0, [good, good, bogus])   # all or nothing
    res["batch"] = "no error"
except VmmError as e:
    res["batch"] = [type(e).__name__, str(e)]
res["batch_left"] = len(rng.mapped)
b.map_pages(rng, 0, [good, good])               # the rolled-back slots are free again
b.unmap(rng, 0, 2)
b.release(good)
b.free_range(rng)
res["usable"] = b.mem_info()[0] > 0
say(res)
b.close()
"""


def test_driver_rejected_handles_are_typed_and_rolled_back():
    # In a child process: a made-up handle is not something a driver has to survive
    # gracefully, and this must not take the test session down if it does not.
    child = Child(REJECTER)
    try:
        res = child.recv()
    finally:
        rc, out, err = child.finish()
    assert rc == 0, err
    assert res["map"][0] in ("InvalidArgument", "DriverError") and "cuMemMap" in res["map"][1], res
    assert res["release"][0] != "no error" and "cuMemRelease" in res["release"][1], res
    assert res["batch"][0] != "no error" and res["map_left"] == 0 and res["batch_left"] == 0, res
    assert res["usable"]


FAULTER = """
import torch
from kvpool.client_lib.tensors import tensor_view
from kvpool.vmm.base import VmmError
b = CudaBackend()
rng = b.reserve(8 * MiB)
p = b.create_page()
b.map(rng, 0, p)                       # slot 0 mapped, slots 1..3 not
t = tensor_view(b, rng, torch.uint8)   # a view over the whole range
res = {}
try:
    t[4 * MiB:].fill_(1)               # touches unmapped slots: GPU MMU fault
    torch.cuda.synchronize()
    res["torch"] = "no error"
except Exception as e:
    res["torch"] = str(e)
for key in ("sync", "sticky"):         # the error is sticky in this process
    try:
        b._synchronize("test")
        res[key] = 0
    except VmmError as e:
        res[key] = getattr(e, "code", -1)
        res[key + "_msg"] = str(e)
say(res)
os._exit(0)                            # the context is dead; skip teardown
"""


def test_touching_an_unmapped_page_faults_only_that_process(backend, torch_cuda):
    torch = torch_cuda
    child = Child(FAULTER)
    res = child.recv()
    child.finish()
    assert "illegal memory access" in res["torch"].lower() or "700" in res["torch"], res
    assert res["sync"] == 700 and res["sticky"] == 700, res
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in res["sync_msg"]
    # the parent is unharmed
    rng = backend.reserve(2 * MiB)
    p = backend.create_page()
    backend.map(rng, 0, p)
    backend.release(p)
    t = view(backend, rng, torch.int32)
    t.fill_(5)
    torch.cuda.synchronize()
    assert int(t.sum()) == 5 * t.numel()
    del t
    backend.free_range(rng)


def test_threads_share_the_primary_context(backend):
    import threading

    rng = backend.reserve(16 * MiB)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            p = backend.create_page()
            backend.zero(p)
            backend.map(rng, i * 2 * MiB, p)
            backend.release(p)
            backend.mem_info()
            backend.unmap(rng, i * 2 * MiB)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    backend.free_range(rng)


KEEPER = """
b = CudaBackend()
import torch
from kvpool.client_lib.tensors import tensor_view
msg, fds = hear()
pages = [b.import_(fd) for fd in fds]
for fd in fds:
    os.close(fd)
rng = b.reserve(len(pages) * 2 * MiB)
b.map_pages(rng, 0, pages)
for p in pages:
    b.release(p)               # the mapping keeps them: a tenant that "released" them
t = tensor_view(b, rng, torch.uint8)
t.fill_(0x5A)
torch.cuda.synchronize()
say("written")
hear()                         # the pages went to another tenant meanwhile
seen = sorted(set(t.cpu().tolist()))
t.fill_(0x66)                  # and writes through its kept mapping
torch.cuda.synchronize()
say({"seen": seen})
hear()
del t
b.unmap(rng, 0, len(pages))
b.free_range(rng)
b.close()
"""


def test_a_page_changing_tenant_is_a_fresh_allocation(backend, torch_cuda):
    """The daemon's pool on a real device: a tenant that keeps a mapping of pages it
    released sees nothing of the next tenant's data, and its writes reach no one."""
    from kvpool.daemon.pool import Pool

    torch = torch_cuda
    pool = Pool(backend, budget_pages=4, warm_min=0, warm_max=4)
    first = pool.take(2, tenant=1)
    child = Child(KEEPER)
    fds = [backend.export(pool.pages[x]) for x in first]
    child.send("pages", fds)
    for fd in fds:
        os.close(fd)
    assert child.recv() == "written"
    pool.give_back(first, tenant=1)
    while pool.has_work():
        pool.maintain(1.0)
    assert pool.renewed == 2 and not set(first) & set(pool.pages)
    second = pool.take(2, tenant=2)
    rng = backend.reserve(4 * MiB)
    backend.map_pages(rng, 0, [pool.pages[x] for x in second])
    t = view(backend, rng)
    assert int(t.count_nonzero()) == 0, "a fresh page is zeroed"
    t.fill_(0x42)
    torch.cuda.synchronize()
    child.send("look")
    assert child.recv()["seen"] == [0x5A], "the kept mapping shows the next tenant's data"
    assert sorted(set(t.cpu().tolist())) == [0x42], "the kept mapping wrote into a new page"
    child.send("done")
    rc, out, err = child.finish()
    assert rc == 0, err
    del t
    backend.unmap(rng, 0, 2)
    backend.free_range(rng)
    pool.give_back(second, tenant=2)
    assert pool.check() == []
    pool.close()


READ_ONLY = """
import torch
from kvpool.client_lib.tensors import tensor_view
b = CudaBackend()
rw, ro = b.reserve(2 * MiB), b.reserve(2 * MiB)
p = b.create_page()
b.map(rw, 0, p)
tensor_view(b, rw, torch.uint8).fill_(0x42)
torch.cuda.synchronize()
b.map_read_only(ro, 0, [p])
t = tensor_view(b, ro, torch.uint8)
say({"head": t[:8].cpu().tolist()})
try:
    t.fill_(7)
    torch.cuda.synchronize()
    say({"write": "done", "head": t[:8].cpu().tolist()})
except Exception as e:  # the store faults: the context is lost, nothing to clean up
    say({"write": "refused", "error": str(e)[:200]})
os._exit(0)
"""


def test_map_read_only_refuses_writes(torch_cuda):
    # weight sets (docs/ARCHITECTURE.md, "Weight sets"): an attacher's mapping is
    # cuMemSetAccess read-only; a kernel's store through it faults (in a child: the
    # fault ends its CUDA context)
    child = Child(READ_ONLY)
    assert child.recv()["head"] == [0x42] * 8
    try:
        got = child.recv()
    except AssertionError:  # the child died of the fault before it could say so
        got = {"write": "refused"}
    rc, out, err = child.finish()
    assert got["write"] == "refused", (got, err)


WEIGHT_ATTACHER = """
import hashlib
import torch
from kvpool.client_lib import connect
from kvpool.client_lib.tensors import tensor_view
from kvpool.client_lib.weights import WeightSet
(run_dir, key), _ = hear()
t = connect(name="attacher", run_dir=run_dir)
ws = WeightSet.attach(t, key)
v = tensor_view(t.backend, ws.range, torch.uint8, (ws.nbytes,))
say({"state": ws.state, "sha": hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest()})
hear()
try:
    v.fill_(7)
    torch.cuda.synchronize()
    say({"write": "done", "head": v[:8].cpu().tolist()})
except Exception as e:  # the store faults: the context is lost, nothing to clean up
    say({"write": "refused", "error": str(e)[:200]})
os._exit(0)
"""


def test_weight_set_through_a_daemon(torch_cuda, tmp_path):
    """Weight sets on CUDA (docs/ARCHITECTURE.md, "Weight sets"), through a real daemon
    with the CUDA backend: this process creates a set (fresh pages read zeros), loads
    it through its writable mapping and seals it; a second process of the same uid
    attaches it, reads the same bytes through its read-only mapping, and its store
    through that mapping faults (its CUDA context dies); the creator's bytes are
    unchanged. (A CUDA set is shared within a uid only: no seal on CUDA.)"""
    import hashlib

    from kvpool.client_lib import connect
    from kvpool.client_lib.tensors import tensor_view
    from kvpool.client_lib.weights import WeightSet
    from kvpool.demo.cluster import Cluster

    torch = torch_cuda
    ps = 2 * MiB
    key = "e5" * 32
    n = 3 * ps + 4096
    with Cluster(tmp_path) as cl:
        cl.daemon(16 * ps, ps, extra=("--log-level", "WARNING"), backend="cuda")
        with connect(name="creator", run_dir=cl.run_dir) as t:
            assert t.backend.caps.read_only_maps and not t.backend.caps.read_only_shares
            ws = WeightSet.create(t, key, n)
            assert ws.state == "loading"
            w = tensor_view(t.backend, ws.range, torch.uint8, (ws.npages * ps,))
            assert int(w.count_nonzero()) == 0, "fresh weight pages read zeros"
            w[:n].copy_(torch.arange(n, device=w.device).remainder(251).to(torch.uint8))
            torch.cuda.synchronize()
            del w
            ws.seal()
            assert ws.state == "sealed"
            r = tensor_view(t.backend, ws.range, torch.uint8, (n,))
            want = hashlib.sha256(r.cpu().numpy().tobytes()).hexdigest()
            child = Child(WEIGHT_ATTACHER)
            child.send([str(cl.run_dir), key])
            got = child.recv()
            assert got == {"state": "sealed", "sha": want}
            child.send("write")
            try:
                wrote = child.recv()
            except AssertionError:  # the child died of the fault before it could say so
                wrote = {"write": "refused"}
            rc, out, err = child.finish()
            assert wrote["write"] == "refused", (wrote, err)
            assert hashlib.sha256(r.cpu().numpy().tobytes()).hexdigest() == want
            del r
            ws.detach()


MUTABLE_READER = """
import hashlib
import torch
from kvpool.client_lib import connect
from kvpool.client_lib.mutable_weights import MutableReader
from kvpool.client_lib.tensors import tensor_view
(run_dir, key, n), _ = hear()
t = connect(name="reader", run_dir=run_dir)
r = MutableReader.attach(t, key)
v = tensor_view(t.backend, r.range, torch.uint8, (n,))
sha = lambda: hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest()
say({"version": r.version, "sha": sha()})
(version,), _ = hear()
r.follow(version)
say({"version": r.version, "sha": sha(), "base": r.range.base == v.data_ptr()})
hear()
try:
    v.fill_(7)
    torch.cuda.synchronize()
    say({"write": "done"})
except Exception as e:  # the store faults: the context is lost, nothing to clean up
    say({"write": "refused", "error": str(e)[:200]})
os._exit(0)
"""


def test_mutable_set_through_a_daemon(torch_cuda, tmp_path):
    """A mutable weight set on CUDA (docs/ARCHITECTURE.md, "Mutable weight sets"),
    through a real daemon with the CUDA backend: this process (a trainer) writes both
    buffers read-write and seals; a second process reads version 1 through its
    cuMemSetAccess read-only mapping; the writer writes the back buffer and publishes;
    the reader remaps to version 2 at the same address and reads the new bytes, and its
    store faults. (Untested on a GPU until scripts/gpu_check.sh runs it.)"""
    import hashlib

    from kvpool.client_lib import connect
    from kvpool.client_lib.mutable_weights import MutableWriter
    from kvpool.client_lib.tensors import tensor_view
    from kvpool.demo.cluster import Cluster

    torch = torch_cuda
    ps = 2 * MiB
    key = "a8" * 32
    n = 2 * ps + 4096
    with Cluster(tmp_path) as cl:
        cl.daemon(16 * ps, ps, extra=("--log-level", "WARNING"), backend="cuda")
        with connect(name="writer", run_dir=cl.run_dir, kind="trainer") as t:
            w = MutableWriter.create(t, key, n)
            stride = w.npages * ps
            both = tensor_view(t.backend, w.buffer_range(), torch.uint8, (2 * stride,))
            bufs = [both[:n], both[stride:stride + n]]
            for b in bufs:
                b.copy_(torch.arange(n, device=b.device).remainder(251).to(torch.uint8))
            torch.cuda.synchronize()
            assert w.seal() == 1
            sha = lambda x: hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()  # noqa: E731
            v1 = sha(bufs[0])
            child = Child(MUTABLE_READER)
            child.send([str(cl.run_dir), key, n])
            assert child.recv() == {"version": 1, "sha": v1}
            assert w.begin_write() == 1
            bufs[1].fill_(0x5A)
            torch.cuda.synchronize()
            assert w.publish() == 2
            child.send([2])
            assert child.recv() == {"version": 2, "sha": sha(bufs[1]), "base": True}
            child.send("write")
            try:
                wrote = child.recv()
            except AssertionError:  # the child died of the fault before it could say so
                wrote = {"write": "refused"}
            rc, out, err = child.finish()
            assert wrote["write"] == "refused", (wrote, err)
            assert sha(bufs[1]) == sha(torch.full((n,), 0x5A, dtype=torch.uint8))
            del both, bufs
            w.close()


def test_devices_all_serves_every_gpu(tmp_path):
    """``kvpool daemon --devices all`` on CUDA (issue 26): one pool per GPU, each with
    its own budget, read per device; a tenant on each GPU gets pages of its own device.
    With two GPUs or more, a TP=2 gang's grant lands on both or neither. A device that
    does not exist is one line and exit status 1 (no traceback)."""
    from kvpool.client_lib import Monitor, connect
    from kvpool.demo.cluster import Cluster
    from kvpool.vmm import device_count

    ps = 2 * MiB
    count = device_count("cuda")
    assert count >= 1
    with Cluster(tmp_path) as cl:
        cl.daemon(8 * ps, ps, extra=("--log-level", "WARNING", "--devices", "all"),
                  backend="cuda")
        for dev in range(count):
            with Monitor(cl.run_dir, device=dev) as m, \
                    connect(name=f"t{dev}", run_dir=cl.run_dir, device=dev) as t:
                g = t.region_group(1, 4 * ps)
                g.grant([0, 1])
                pool = m.ps().pool
                assert pool is not None and pool.device == dev and pool.budget == 8 * ps
                assert pool.granted == 2 * ps and m.check() == []
        if count >= 2:
            import threading

            layout = [(1, 4 * ps)]
            with connect(name="tp", run_dir=cl.run_dir, device=0) as r0:
                token = r0.create_gang([0, 1], layout)
                with connect(name="tp", run_dir=cl.run_dir, device=1, gang=token, rank=1,
                             layout=layout) as r1:
                    g0, g1 = r0.region_group(*layout[0]), r1.region_group(*layout[0])
                    th = threading.Thread(target=g1.grant, args=([0, 1],))
                    th.start()
                    g0.grant([0, 1])
                    th.join(30)
                    assert g0.mapped == g1.mapped == {0, 1}
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "daemon", "--backend",
                          "cuda", "--devices", f"0,{count}", "--run-dir",
                          str(tmp_path / "missing")], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert f"device {count}" in out.stderr, out.stderr
