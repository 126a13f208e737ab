"""Zero-copy torch tensors over reserved virtual ranges, through DLPack.

One mechanism for both backends: a ctypes-built ``DLManagedTensor`` whose device is
``kDLCPU`` (host backend) or ``kDLCUDA`` (CUDA backend). torch takes the device from the
capsule, so no pointer lookup is needed and the first page need not be mapped yet.

Lifetime: the range is pinned (``Backend.pin``) while any tensor or view derived from
the capsule exists; torch calls our deleter when the last one dies, which unpins it. A
``free_range`` issued meanwhile is deferred until then, so a live view never points at
address space someone else could take. Touching an *unmapped* page through a view is
still the caller's bug: SIGSEGV on host, a sticky illegal-address error on CUDA.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any, Sequence

import torch

from kvpool.vmm.base import Backend, InvalidArgument, Range

KDL_CPU, KDL_CUDA = 1, 2
KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_pythonapi = ctypes.pythonapi
_pythonapi.PyCapsule_New.restype = ctypes.py_object
_pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# Keeps each capsule's ctypes structs (and the range's unpin) alive until torch is done.
_live: dict[int, tuple[Backend, Range, _DLManagedTensor, Any]] = {}
_live_lock = threading.Lock()
_keys = itertools.count(1)


def _unpin_capsule(managed: Any) -> None:
    """torch is done with a capsule: forget its structs and unpin its range."""
    key = managed.contents.manager_ctx
    with _live_lock:
        entry = _live.pop(key, None)
    if entry is not None:
        backend, rng = entry[0], entry[1]
        backend.unpin(rng)


_on_delete = _DELETER(_unpin_capsule)


def live_views() -> int:
    """Number of capsules whose tensors are still alive (for tests and leak checks)."""
    with _live_lock:
        return len(_live)


def _byte_tensor(backend: Backend, rng: Range, offset: int, nbytes: int) -> torch.Tensor:
    cuda = backend.caps.tensor_device == "cuda"
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = rng.base + offset
    managed.dl_tensor.device = _DLDevice(KDL_CUDA if cuda else KDL_CPU, backend.device if cuda else 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None  # compact, row-major
    managed.dl_tensor.byte_offset = 0
    key = next(_keys)
    managed.manager_ctx = key
    managed.deleter = _on_delete
    backend.pin(rng)
    with _live_lock:
        _live[key] = (backend, rng, managed, shape)
    try:
        capsule = _pythonapi.PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _live_lock:
            _live.pop(key, None)
        backend.unpin(rng)
        raise


def tensor_view(
    backend: Backend,
    rng: Range,
    dtype: torch.dtype = torch.uint8,
    shape: Sequence[int] | None = None,
    offset: int = 0,
    nbytes: int | None = None,
) -> torch.Tensor:
    """A tensor over ``[offset, offset + nbytes)`` of ``rng``, viewed as ``dtype``/``shape``.

    ``nbytes`` defaults to the product of ``shape`` (or the rest of the range). Any dtype
    works, bfloat16 included. The tensor aliases the range's memory: writes are visible
    to every mapping of the same pages, in any process.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes is None:
        nbytes = (
            int(torch.Size(shape).numel()) * itemsize if shape is not None else rng.size - offset
        )
    if offset < 0 or nbytes <= 0 or offset + nbytes > rng.size:
        raise InvalidArgument(
            "tensor_view", f"[{offset}, {offset + nbytes}) is outside the range of size {rng.size}"
        )
    if offset % itemsize or nbytes % itemsize:
        raise InvalidArgument(
            "tensor_view", f"offset {offset} / nbytes {nbytes} not aligned to {dtype} ({itemsize} B)"
        )
    flat = _byte_tensor(backend, rng, offset, nbytes).view(dtype)
    return flat if shape is None else flat.view(*shape)
