"""Reading a GGUF file: its metadata and its tensors, dequantized to float32 numpy arrays.

The file is parsed by the ``gguf`` package's :class:`gguf.GGUFReader` (memory-mapped); this
module adds the checks a converter needs (magic, truncation, tensor types) with one-line
:class:`GGUFError` messages, and the dequantization of the block formats, vectorized over
every block of a tensor at once:

==========  =============================================  ==========================
type        block (bytes)                                  value
==========  =============================================  ==========================
F32 / F16   one element                                    as stored
BF16        one element (the top 16 bits of a float32)     as stored
Q8_0        32 elements: d f16, 32 x int8 (34)             d * q
Q4_0        32 elements: d f16, 16 bytes of nibbles (18)   d * (q - 8)
Q4_1        32 elements: d f16, m f16, 16 bytes (20)       d * q + m
==========  =============================================  ==========================

In Q4_0/Q4_1 the low nibbles of the 16 bytes are elements 0-15 and the high nibbles 16-31.
Q5_0, Q5_1 and the k-quants (Q2_K ... Q6_K) are handed to ``gguf.quants.dequantize``;
any other type is refused with the tensor's name and type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.engine.errors import CheckpointError

MAGIC = b"GGUF"

# Types this module dequantizes itself / hands to gguf.quants (named, not imported, so the
# tables stay readable without the gguf package).
OWN_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
DELEGATED_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = OWN_TYPES + DELEGATED_TYPES

F32Array = npt.NDArray[np.float32]


class GGUFError(CheckpointError):
    """A GGUF file that cannot be converted; the message (one line) says why."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in numpy (row-major) order, i.e. GGUF's ``ne``
    reversed, so a weight reads ``(out_features, in_features)`` like in PyTorch."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    raw: npt.NDArray[Any]  # the reader's memory-mapped view of the stored bytes/elements


class GGUFFile:
    """The metadata and tensors of one GGUF file.

    Raises:
        GGUFError: the file is missing, does not start with the GGUF magic, or its header or
            tensor data extend past its end (truncated).
    """

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (magic {magic!r}, "
                            f"expected {MAGIC!r})")
        try:
            reader = GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError/IndexError/... on short data
            raise GGUFError(f"{self.path} is truncated or corrupt: cannot parse its header "
                            f"({type(e).__name__}: {e})") from None
        size = self.path.stat().st_size
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                self.metadata[key] = field.contents()
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise GGUFError(f"{self.path} is truncated: tensor {t.name} needs bytes up to "
                                f"{int(t.data_offset) + int(t.n_bytes)}, the file has {size}")
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, t.tensor_type.name, shape, t.data)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture")
        return arch

    def unsupported_tensors(self) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.type_name not in SUPPORTED_TYPES]

    def dequantize(self, name: str) -> F32Array:
        """Tensor ``name`` as float32 in its numpy ``shape``."""
        t = self.tensors[name]
        return dequantize(t.raw, t.type_name, t.shape, name)


def dequantize(raw: npt.NDArray[Any], type_name: str, shape: tuple[int, ...],
               name: str = "tensor") -> F32Array:
    """float32 values of ``raw`` (the stored elements, or bytes for block formats) of GGUF
    type ``type_name``, reshaped to ``shape``.

    Raises:
        GGUFError: an unsupported type, or a byte count that does not fit ``shape``.
    """
    n = int(np.prod(shape)) if shape else 1
    if type_name == "F32":
        out = np.array(np.asarray(raw).view(np.float32))  # a writable copy of the map
    elif type_name == "F16":
        out = np.asarray(raw).view(np.float16).astype(np.float32)
    elif type_name == "BF16":
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        out = bits.view(np.float32)
    elif type_name in ("Q8_0", "Q4_0", "Q4_1"):
        out = _dequant_blocks(np.ascontiguousarray(raw).view(np.uint8).reshape(-1),
                              type_name, n, name)
    elif type_name in DELEGATED_TYPES:
        from gguf import GGMLQuantizationType, quants

        try:
            out = quants.dequantize(np.asarray(raw), GGMLQuantizationType[type_name])
        except Exception as e:
            raise GGUFError(f"tensor {name}: cannot dequantize {type_name}: {e}") from None
    else:
        raise GGUFError(f"tensor {name} has unsupported type {type_name} (supported: "
                        f"{', '.join(SUPPORTED_TYPES)})")
    out = np.asarray(out, dtype=np.float32).reshape(-1)
    if out.size != n:
        raise GGUFError(f"tensor {name}: {out.size} values stored, shape {shape} needs {n}")
    return out.reshape(shape)


_BLOCK = 32
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _dequant_blocks(b: npt.NDArray[np.uint8], type_name: str, n: int, name: str) -> F32Array:
    nbytes = _BLOCK_BYTES[type_name]
    if n % _BLOCK or b.size != n // _BLOCK * nbytes:
        raise GGUFError(f"tensor {name}: {b.size} bytes of {type_name} do not hold {n} "
                        f"elements ({nbytes} bytes per {_BLOCK})")
    blocks = b.reshape(-1, nbytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (nblocks, 1)
    if type_name == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    start = 4 if type_name == "Q4_1" else 2
    packed = blocks[:, start:start + 16]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    if type_name == "Q4_0":
        values: F32Array = (d * (q - 8.0)).reshape(-1)
        return values
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    values = (d * q + m).reshape(-1)
    return values
