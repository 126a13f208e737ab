"""The CUDA backend against a fake driver: CALLING CONVENTIONS ONLY.

``tests/cuda_stub/libcuda_stub.c`` is compiled with gcc into a temporary directory as
``libcuda.so.1``; each test runs ``kvpool.vmm.cuda`` in a subprocess whose
``LD_LIBRARY_PATH`` points there, so cuda-bindings (which dlopens ``libcuda.so.1`` by
system search and resolves every entry point through ``cuGetProcAddress_v2``) talks to
the stub. The stub backs "device memory" with host memory (memfd allocations, mmap
reservations), so the tests can check argument order and types, return-tuple handling,
fd passing between real processes, all-or-nothing rollback and the mapping of driver
error codes onto kvpool's typed errors.

They prove nothing about real driver behaviour, device memory or timing: that is what
``tests/test_vmm_cuda.py`` (marked ``gpu``) checks on a GPU. Skipped when gcc is absent.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STUB_SRC = Path(__file__).parent / "cuda_stub" / "libcuda_stub.c"
REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20

PRELUDE = """
import ctypes, os, socket, subprocess, sys, threading
from kvpool.vmm import base
from kvpool.vmm.base import InvalidArgument, OutOfMemory, Unsupported, DriverError, Page
from kvpool.vmm.cuda import CudaBackend, probe
MiB = 1 << 20

def raises(exc, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except exc as e:
        return str(e)
    except Exception as e:
        raise AssertionError(f"expected {exc.__name__}, got {type(e).__name__}: {e}")
    raise AssertionError(f"expected {exc.__name__}, nothing raised")

def peek(addr, n):
    return ctypes.string_at(addr, n)
"""


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("gcc is not available to build the libcuda stub")
    out = tmp_path_factory.mktemp("cuda_stub")
    proc = subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-o", str(out / "libcuda.so.1"), str(STUB_SRC)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"could not build the libcuda stub: {proc.stderr.strip()[:500]}")
    return out


def run_stub(stub_dir: Path, code: str, lib_dir: Path | None = None, **env: str) -> str:
    """Run PRELUDE + ``code`` in a fresh interpreter on the stub; return its stdout."""
    environ = dict(os.environ)
    environ["LD_LIBRARY_PATH"] = str(lib_dir or stub_dir)
    environ["PYTHONPATH"] = str(REPO) + os.pathsep + environ.get("PYTHONPATH", "")
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    environ.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"stub subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_init_probe_and_page_size(stub_dir):
    out = run_stub(
        stub_dir,
        """
        assert probe() is None, probe()
        b = CudaBackend()
        assert b.name == "cuda" and b.min_page_size() == 2 * MiB and b.page_size == 2 * MiB
        assert b.rdma_capable
        uuid = b.device_uuid()
        assert uuid.startswith("GPU-") and len(uuid) == 40, uuid
        free, total = b.mem_info()
        assert free == total == 1 << 30
        b.close(); b.close()  # idempotent
        raises(InvalidArgument, b.mem_info)  # closed backend refuses politely
        b4 = CudaBackend(page_size=4 * MiB)
        r = b4.reserve(8 * MiB)
        assert r.base % (4 * MiB) == 0  # reservations aligned to the page size
        b4.free_range(r); b4.close()
        msg = raises(InvalidArgument, CudaBackend, page_size=3 * MiB)
        assert "minimum page size 2097152" in msg, msg
        from kvpool.vmm import open_backend, cuda_available
        assert cuda_available()
        ob = open_backend("auto"); assert ob.name == "cuda"; ob.close()
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_size_contract_unit_is_page_size(stub_dir):
    # The twin of tests/test_vmm_size_contract.py: with pages of twice the driver's
    # granularity, a size or offset that is a multiple of the granularity only is refused.
    out = run_stub(
        stub_dir,
        """
        b = CudaBackend(page_size=4 * MiB)
        assert b.min_page_size() == 2 * MiB
        assert not hasattr(base.Backend, "granularity")
        msg = raises(InvalidArgument, b.reserve, 2 * MiB)
        assert "multiple of page size 4194304" in msg, msg
        msg = raises(InvalidArgument, b.reserve, 6 * MiB)
        assert "multiple of page size 4194304" in msg, msg
        r = b.reserve(8 * MiB)
        p = b.create_page()
        assert p.size == 4 * MiB
        msg = raises(InvalidArgument, b.map, r, 2 * MiB, p)
        assert "multiple of page size 4194304" in msg, msg
        b.map(r, 4 * MiB, p)
        msg = raises(InvalidArgument, b.unmap, r, 6 * MiB)
        assert "multiple of page size 4194304" in msg, msg
        b.unmap(r, 4 * MiB); b.release(p); b.free_range(r); b.close()
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_reserve_costs_nothing_and_map_write_read(stub_dir):
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        free0, _ = b.mem_info()
        r = b.reserve(64 << 30)
        assert b.mem_info()[0] == free0, "a reservation must cost no memory"
        pages = [b.create_page() for _ in range(3)]
        assert b.mem_info()[0] == free0 - 6 * MiB
        b.map_pages(r, 2 * MiB, pages)
        assert sorted(r.mapped) == [2 * MiB, 4 * MiB, 6 * MiB]
        ctypes.memset(r.base + 2 * MiB, 0x5A, 6 * MiB)
        assert peek(r.base + 7 * MiB, 4) == b"\\x5a" * 4
        for p in pages:
            b.release(p)  # mappings keep the memory alive
        assert b.mem_info()[0] == free0 - 6 * MiB
        assert peek(r.base + 2 * MiB, 2) == b"ZZ"
        b.unmap(r, 2 * MiB, 3)
        assert r.mapped == {} and b.mem_info()[0] == free0
        # unmapped slots stay reserved: they can be mapped again
        p = b.create_page(); b.map(r, 2 * MiB, p); b.release(p); b.unmap(r, 2 * MiB)
        b.free_range(r)
        assert b.mem_info()[0] == free0
        b.close()
        """,
    )


def test_unmap_coalesces_runs_and_free_range_unmaps(stub_dir):
    # The stub logs every call; check one cuMemSetAccess per run, one cuMemUnmap per run.
    environ_log = {"KVPOOL_STUB_LOG": "1"}
    code = """
        b = CudaBackend()
        r = b.reserve(16 * MiB)
        ps = [b.create_page() for _ in range(4)]
        sys.stderr.write("=== map\\n"); sys.stderr.flush()
        b.map_pages(r, 0, ps[:2]); b.map_pages(r, 4 * MiB, ps[2:])
        sys.stderr.write("=== unmap\\n"); sys.stderr.flush()
        b.unmap(r, 0, 3)
        sys.stderr.write("=== free\\n"); sys.stderr.flush()
        for p in ps: b.release(p)
        b.free_range(r)  # slot 3 still mapped: unmapped first, then the range freed
        sys.stderr.write("=== end\\n"); sys.stderr.flush()
        assert b.mem_info()[0] == 1 << 30
        b.close()
    """
    environ = dict(os.environ, LD_LIBRARY_PATH=str(stub_dir), **environ_log)
    environ["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, env=environ, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    log = proc.stderr
    mapping = log.split("=== map")[1].split("=== unmap")[0]
    assert mapping.count("cuMemMap(") == 4 and mapping.count("cuMemSetAccess(") == 2
    assert "4194304, count=1" in mapping  # one access call covering both pages of a run
    unmapping = log.split("=== unmap")[1].split("=== free")[0]
    assert unmapping.count("cuMemUnmap(") == 1 and f", {6 * MiB})" in unmapping
    freeing = log.split("=== free")[1].split("=== end")[0]
    assert freeing.count("cuMemUnmap(") == 1 and "cuMemAddressFree(" in freeing


def test_bad_arguments_raise_typed_errors_and_backend_stays_usable(stub_dir):
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        r = b.reserve(8 * MiB)
        p = b.create_page()
        raises(InvalidArgument, b.reserve, 3 * MiB)
        raises(InvalidArgument, b.reserve, 0)
        raises(InvalidArgument, b.map, r, 1 * MiB, p)          # unaligned offset
        raises(InvalidArgument, b.map, r, 8 * MiB, p)          # outside the range
        raises(InvalidArgument, b.map_pages, r, 6 * MiB, [p, p])  # runs past the end
        b.map(r, 0, p)
        raises(InvalidArgument, b.map, r, 0, p)                # over a mapped slot
        raises(InvalidArgument, b.unmap, r, 2 * MiB)           # never mapped
        raises(InvalidArgument, b.unmap, r, 0, 2)              # partly mapped
        b.unmap(r, 0)
        raises(InvalidArgument, b.unmap, r, 0)                 # double unmap
        fd = b.export(p)
        b.release(p)
        raises(InvalidArgument, b.release, p)                  # double release
        raises(InvalidArgument, b.export, p)
        raises(InvalidArgument, b.zero, p)
        raises(InvalidArgument, b.map, r, 0, p)
        os.close(fd)
        msg = raises(InvalidArgument, b.import_, fd)           # closed fd
        assert str(fd) in msg
        raises(InvalidArgument, b.import_, -1)
        raises(InvalidArgument, b.retain_handle, r.base)       # nothing mapped there
        # a driver-rejected call names the call and the error
        bogus = Page(handle=123456, size=2 * MiB)
        msg = raises(InvalidArgument, b.map, r, 0, bogus)
        assert "cuMemMap(" in msg and "CUDA_ERROR_INVALID_HANDLE" in msg, msg
        msg = raises(InvalidArgument, b.release, Page(handle=123456, size=2 * MiB))
        assert "cuMemRelease" in msg
        raises(InvalidArgument, b.map, r, 0, Page(handle=1, size=4 * MiB))  # wrong size
        # still fully usable
        q = b.create_page(); b.map(r, 0, q); ctypes.memset(r.base, 1, 16)
        assert peek(r.base, 2) == b"\\x01\\x01"
        b.unmap(r, 0); b.release(q); b.free_range(r)
        raises(InvalidArgument, b.free_range, r)
        raises(InvalidArgument, b.map, r, 0, b.create_page())  # freed range
        b.close()
        """,
    )


def test_map_pages_is_all_or_nothing(stub_dir):
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        r = b.reserve(8 * MiB)
        good = [b.create_page(), b.create_page()]
        bogus = Page(handle=987654, size=2 * MiB)
        free_before = b.mem_info()[0]
        raises(InvalidArgument, b.map_pages, r, 0, [good[0], good[1], bogus])
        assert r.mapped == {}
        b.map_pages(r, 0, good)  # the rolled-back slots are free to map again
        ctypes.memset(r.base, 0x33, 2 * MiB); ctypes.memset(r.base + 2 * MiB, 0x44, 2 * MiB)
        assert peek(r.base + 2 * MiB - 2, 4) == b"\\x33\\x33\\x44\\x44"
        b.unmap(r, 0, 2)
        for p in good: b.release(p)
        b.free_range(r)
        assert b.mem_info()[0] == free_before + 4 * MiB
        b.close()
        """,
    )


def test_out_of_memory_is_typed(stub_dir):
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        a, c = b.create_page(), b.create_page()
        msg = raises(OutOfMemory, b.create_page)
        assert "cuMemCreate" in msg and "OUT_OF_MEMORY" in msg, msg
        b.release(a)
        d = b.create_page()
        b.release(c); b.release(d)
        b.close()
        """,
        KVPOOL_STUB_TOTAL=str(4 * MiB),
    )


def test_zero_zeroes_through_the_scratch_range(stub_dir):
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        r = b.reserve(4 * MiB)
        p = b.create_page()
        b.map(r, 2 * MiB, p)
        ctypes.memset(r.base + 2 * MiB, 0xFF, 2 * MiB)
        b.zero(p)  # maps p privately, memsets on the backend's stream, unmaps
        assert peek(r.base + 2 * MiB, 2 * MiB) == bytes(2 * MiB)
        assert r.mapped == {2 * MiB: p.handle}
        b.zero(p)  # the scratch slot was unmapped again
        b.unmap(r, 2 * MiB); b.release(p); b.free_range(r); b.close()
        """,
    )


IMPORTER_CHILD = """
from kvpool import fdchannel
sock = socket.socket(fileno=int(sys.argv[1]))
b = CudaBackend()
data, fds = fdchannel.recv_fds(sock)
page = b.import_(fds[0])
os.close(fds[0])  # the caller closes the fd after import
r = b.reserve(2 * MiB)
b.map(r, 0, page)
b.release(page)
seen = peek(r.base, 4)
ctypes.memset(r.base + 4, 0x43, 4)  # write back through the importer's mapping
fdchannel.send_fds(sock, seen, [])
fdchannel.recv_fds(sock)  # wait until the parent has looked
b.unmap(r, 0); b.free_range(r); b.close()
"""


def test_export_import_across_processes(stub_dir):
    # The stub's exported handle is a real memfd, so this shows the fd plumbing
    # (export -> SCM_RIGHTS -> import, close after import) end to end.
    run_stub(
        stub_dir,
        """
        from kvpool import fdchannel
        b = CudaBackend()
        r = b.reserve(4 * MiB)
        p = b.create_page()
        b.map(r, 0, p)
        ctypes.memset(r.base, 0x42, 2 * MiB)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child_code = os.environ['KVPOOL_TEST_PRELUDE'] + os.environ['KVPOOL_TEST_CHILD']
        proc = subprocess.Popen([sys.executable, "-c", child_code, str(child.fileno())],
                                pass_fds=[child.fileno()])
        child.close()
        fd = b.export(p)
        assert isinstance(fd, int) and fd >= 0 and not os.get_inheritable(fd)
        fdchannel.send_fds(parent, b"page", [fd])
        os.close(fd)
        data, _ = fdchannel.recv_fds(parent)
        assert data == b"BBBB", data
        assert peek(r.base, 8) == b"BBBBCCCC", peek(r.base, 8)
        fdchannel.send_fds(parent, b"done", [])
        assert proc.wait(60) == 0
        b.unmap(r, 0); b.release(p); b.free_range(r); b.close()
        """,
        KVPOOL_TEST_CHILD=IMPORTER_CHILD,
        KVPOOL_TEST_PRELUDE=PRELUDE,
    )


def test_retain_handle_reexports_a_mapped_page(stub_dir):
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        r = b.reserve(4 * MiB)
        p = b.create_page()
        b.map(r, 2 * MiB, p)
        b.release(p)  # only the mapping holds it now
        again = b.retain_handle(r.base + 2 * MiB + 4096)
        assert again.handle == p.handle
        fd = b.export(again)
        os.close(fd)
        b.release(again)
        b.unmap(r, 2 * MiB)
        assert b.mem_info()[0] == b.mem_info()[1]
        b.free_range(r); b.close()
        """,
    )


def test_other_threads_get_the_context(stub_dir):
    # The stub fails context-dependent calls on a thread with no current context.
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        r = b.reserve(8 * MiB)
        errors = []
        def work(i):
            try:
                p = b.create_page(); b.zero(p)
                b.map(r, i * 2 * MiB, p); b.release(p)
                b.mem_info(); b.unmap(r, i * 2 * MiB)
            except Exception as e:
                errors.append(e)
        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts: t.start()
        for t in ts: t.join()
        assert not errors, errors
        b.free_range(r); b.close()
        """,
    )


def test_free_range_deferred_while_pinned(stub_dir):
    run_stub(
        stub_dir,
        """
        b = CudaBackend()
        r = b.reserve(2 * MiB)
        p = b.create_page(); b.map(r, 0, p); b.release(p)
        ctypes.memset(r.base, 0x5C, 2 * MiB)
        b.pin(r)
        b.free_range(r)
        assert not r.freed and r.mapped  # still reserved and mapped while pinned
        assert peek(r.base, 2) == peek(r.base + 2 * MiB - 2, 2) == b"\\x5c\\x5c"
        b.unpin(r)
        assert r.freed and r.mapped == {}
        assert b.mem_info()[0] == b.mem_info()[1]
        b.close()
        """,
    )


@pytest.mark.parametrize(
    "env, device, words",
    [
        ({"KVPOOL_STUB_ATTR_102": "0"}, 0, "virtual memory management"),
        ({"KVPOOL_STUB_ATTR_103": "0"}, 0, "POSIX file descriptors"),
        ({"KVPOOL_STUB_ATTR_20": "3"}, 0, "EXCLUSIVE_PROCESS"),
        ({"KVPOOL_STUB_INIT_ERROR": "100"}, 0, "CUDA_ERROR_NO_DEVICE"),
        ({"KVPOOL_STUB_DEVICES": "0"}, 0, "no devices"),
        ({}, 3, "device 3 does not exist"),
    ],
)
def test_capability_checks(stub_dir, env, device, words):
    out = run_stub(
        stub_dir,
        f"""
        reason = probe({device})
        assert reason and {words!r} in reason, reason
        msg = raises(Unsupported, CudaBackend, device={device})
        assert {words!r} in msg, msg
        from kvpool.vmm import cuda_available
        assert not cuda_available({device})
        print(reason)
        """,
        **env,
    )
    assert words in out


def test_rdma_flag_follows_the_attribute(stub_dir):
    env = {"KVPOOL_STUB_ATTR_110": "0", "KVPOOL_STUB_LOG": "1"}
    code = "b = CudaBackend(); assert not b.rdma_capable; b.close()"
    environ = dict(os.environ, LD_LIBRARY_PATH=str(stub_dir), PYTHONPATH=str(REPO), **env)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        capture_output=True, text=True, env=environ, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "handles=1, loc=1/0, rdma=0" in proc.stderr


@pytest.mark.skipif(
    ctypes.util.find_library("cuda") is not None, reason="a real libcuda is installed here"
)
def test_no_driver_is_unsupported(tmp_path):
    # An empty LD_LIBRARY_PATH directory and no system libcuda: the first driver call
    # raises RuntimeError inside cuda-bindings, which must surface as Unsupported.
    out = run_stub(
        tmp_path,
        """
        reason = probe()
        assert reason and "not usable" in reason, reason
        raises(Unsupported, CudaBackend)
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_map_read_only_sets_read_access(stub_dir):
    # weight sets (docs/ARCHITECTURE.md, "Weight sets"): attachers map read-only; the
    # stub turns cuMemSetAccess's flags into mprotect, so a store through the mapping
    # would fault and the bytes written through a writable mapping read back
    code = """
        b = CudaBackend()
        assert not b.caps.read_only_shares  # a handle holder could map it writable: no seal
        rw, ro = b.reserve(2 * MiB), b.reserve(2 * MiB)
        page = b.create_page()
        b.map_pages(rw, 0, [page])
        ctypes.memset(rw.base, 0x5A, 16)
        sys.stderr.write("=== ro\\n"); sys.stderr.flush()
        b.map_read_only(ro, 0, [page])
        sys.stderr.write("=== end\\n"); sys.stderr.flush()
        assert peek(ro.base, 4) == b"ZZZZ"
        b.unmap(ro, 0); b.unmap(rw, 0); b.release(page)
        b.free_range(ro); b.free_range(rw); b.close()
    """
    environ = dict(os.environ, LD_LIBRARY_PATH=str(stub_dir), KVPOOL_STUB_LOG="1")
    environ["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, env=environ, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    mapping = proc.stderr.split("=== ro")[1].split("=== end")[0]
    assert mapping.count("cuMemSetAccess(") == 1 and "flags=1)" in mapping  # PROT_READ


def test_devices_all_opens_a_stack_per_stub_device(stub_dir):
    """``--devices all`` on the cuda backend (issue 26): the driver's device count, one
    backend opened on each ordinal and one pool per device (calling conventions only:
    the stub's devices are host memory)."""
    out = run_stub(
        stub_dir,
        """
        from kvpool.daemon.config import Config
        from kvpool.daemon.devices import Devices
        from kvpool.vmm import device_count
        n = device_count("cuda")
        cfg = Config.from_dict({"backend": "cuda", "devices": "all", "budget": "8MiB",
                                "device_budgets": {"1": "4MiB"}})
        devs = Devices(cfg)
        print(n, sorted(devs.stacks), [s.backend.device for s in devs],
              [s.pool.budget_pages for s in devs])
        devs.close()
        """,
        KVPOOL_STUB_DEVICES="3",
    )
    assert out.split("\n")[0] == "3 [0, 1, 2] [0, 1, 2] [4, 2, 4]", out
