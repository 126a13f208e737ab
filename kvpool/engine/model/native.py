"""The native CPU kernels (paged attention and fused ops, each in an fp32 and a bf16 variant):
build once (g++ -O3 -march=native -fopenmp), load via ctypes.

Why ctypes and not ``torch.utils.cpp_extension``: the kernel only needs raw pointers, so it
includes no torch header and compiles in about a second instead of a minute, and it does not
depend on torch's C++ ABI. The shared object goes to ``$KVPOOL_NATIVE_DIR`` (default
``~/.cache/kvpool/native``) under a name that hashes the source, the flags and the machine,
so a changed kernel or a different CPU rebuilds; concurrent builders race harmlessly
(build to a temporary name, then an atomic rename).

The engine builds it on first use (``make test`` on a fresh machine does so while
collecting the engine tests); ``python -c "from kvpool.engine import native;
print(native.build())"`` builds it ahead of time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SOURCES = [Path(__file__).with_name("csrc") / n for n in ("paged_attention.cpp", "cpu_ops.cpp")]
SOURCE = SOURCES[0]
HEADERS = [Path(__file__).with_name("csrc") / "vec8.h"]  # part of the build's identity
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
         "-fno-math-errno"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def cache_dir() -> Path:
    return Path(os.environ.get("KVPOOL_NATIVE_DIR")
                or Path.home() / ".cache" / "kvpool" / "native")


def _target() -> Path:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(platform.machine().encode())
    try:
        h.update(Path("/proc/cpuinfo").read_bytes().split(b"\n\n")[0])  # -march=native
    except OSError:
        pass
    return cache_dir() / f"paged_attention-{h.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernel unless an up-to-date build exists; returns the .so path.

    Raises:
        RuntimeError: no C++ compiler, or the compile failed (message has its stderr).
    """
    out = _target()
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, or None when it cannot be built here (``error()`` says
    why). Loads torch first so the kernel binds torch's OpenMP runtime."""
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        try:
            import torch  # noqa: F401  (its libgomp must be loaded first)

            lib = ctypes.CDLL(str(build()))
        except (RuntimeError, OSError) as e:
            _error = str(e)
            return None
        for name in ("kvpool_paged_attention", "kvpool_paged_attention_bf16"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I32,
                           _I32, _I32, _I32, _I32, _F]
        lib.kvpool_store_kv.restype = None
        lib.kvpool_store_kv.argtypes = [_P, _P, _P, _P, _I64, _I64, _P, _I32, _I64, _I64,
                                        _I32, _I32]
        _declare_cpu_ops(lib)
        _lib = lib
        return lib


def _declare_cpu_ops(lib: ctypes.CDLL) -> None:
    """Signatures of csrc/cpu_ops.cpp (see its header for what each computes)."""
    lib.kvpool_linear_small.restype = ctypes.c_int
    lib.kvpool_linear_small.argtypes = [_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I64]
    lib.kvpool_linear_bf16.restype = ctypes.c_int
    lib.kvpool_linear_bf16.argtypes = [_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I64]
    for sfx in ("", "_bf16"):  # the fp32 entry point and its bf16 twin
        for name, argtypes in (
                ("kvpool_rmsnorm", [_P, _I64, _P, _I64, _P, _P, _I64, _I32, _I32, _F]),
                ("kvpool_rotary", [_P, _I64, _I64, _I32, _I32, _I32, _P, _P, _P, _I32]),
                ("kvpool_silu_mul", [_P, _I64, _P, _I64, _I32, _I32])):
            fn = getattr(lib, name + sfx)
            fn.restype = None
            fn.argtypes = argtypes
    lib.kvpool_argmax.restype = None
    lib.kvpool_argmax.argtypes = [_P, _I64, _I32, _I32, _P]


def error() -> str | None:
    return _error


def suffix(dtype: torch.dtype) -> str | None:
    """The entry-point suffix of the kernels' variant for a torch dtype: ``""`` for
    float32, ``"_bf16"`` for bfloat16 (bf16 storage, fp32 arithmetic), None for the dtypes
    no kernel handles (float16 and the rest: callers use their torch path)."""
    import torch

    if dtype == torch.float32:
        return ""
    return "_bf16" if dtype == torch.bfloat16 else None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_MAX = 32 << 20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit


def tune_malloc(trim_threshold: int = 1 << 30) -> bool:
    """Keep freed step temporaries (MLP activations, logits: up to ~16 MB at 2,048 tokens)
    in glibc's heap instead of unmapping them, so the next step does not fault in fresh
    zeroed pages: fixed mmap threshold at its 32 MiB maximum, heap trimmed only above
    ``trim_threshold``. Process-wide (the engine owns the process's hot loop); a no-op
    returning False outside glibc."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX) == 1)
        return ok and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1)
    except (OSError, AttributeError):
        return False


