"""KV cache storage: where the bytes live, in one of two layouts, injectable from outside.

``block_major``: one buffer ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``; a
memory page holds whole blocks for every layer.
``per_layer``: ``2 * layers`` buffers ``[num_blocks, block_size, kv_heads, head_dim]``, ordered
``[k_0, v_0, k_1, v_1, ...]``.

Either way ``layers[i] == (k_cache, v_cache)`` with shape ``[num_blocks, block_size, kv_heads,
head_dim]`` (block-major gives strided views), which is all attention ever sees.

Injection: :meth:`KVCache.from_buffers` reinterprets caller-provided tensors of any dtype
(e.g. zero-copy uint8 views over memory mapped by kvpool) without copying; the caller keeps
them alive and mapped for every block id the block pool may hand out. A caller may space
blocks further apart than their size (``block_stride``: padding after each block, so a
block divides its allocator's page run); the views are then strided in the block
dimension, which attention reads through ``stride(0)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVLayout = Literal["block_major", "per_layer"]


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one KV block; ``block_bytes`` covers all layers, K and V."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: KVLayout = "block_major"

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        bs, h, d = self.layer_block_shape
        return self.num_layers * 2 * bs * h * d * self.elem_bytes

    @property
    def num_buffers(self) -> int:
        return 1 if self.layout == "block_major" else 2 * self.num_layers

    @property
    def buffer_block_bytes(self) -> int:
        """Bytes one block occupies in each buffer."""
        return self.block_bytes // self.num_buffers


class KVCache:
    """Per-layer (k_cache, v_cache) views over one or ``2 * layers`` buffers.

    Invariant: every view has exactly ``num_blocks`` blocks; block ids handed out by the pool
    must be ``< num_blocks``.
    """

    def __init__(self, spec: KVCacheSpec, buffers: list[torch.Tensor], num_blocks: int) -> None:
        self.spec = spec
        self.buffers = buffers
        self.num_blocks = num_blocks
        self.layers = _views(spec, buffers, num_blocks)

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> KVCache:
        """The default: preallocate zeroed storage for ``num_blocks`` blocks."""
        shape = _buffer_shape(spec, num_blocks)
        bufs = [torch.zeros(shape, dtype=spec.dtype, device=device)
                for _ in range(spec.num_buffers)]
        return cls(spec, bufs, num_blocks)

    @classmethod
    def from_buffers(cls, spec: KVCacheSpec, buffers: list[torch.Tensor],
                     num_blocks: int | None = None, block_stride: int | None = None
                     ) -> KVCache:
        """Wrap externally owned storage without copying.

        Args:
            buffers: 1 tensor (block_major) or ``2 * layers`` (per_layer, ``[k0, v0, k1, ...]``),
                contiguous, on the engine's device, any dtype; each at least
                ``num_blocks * block_stride`` bytes.
            num_blocks: blocks to expose; default: as many as the smallest buffer holds.
            block_stride: bytes from one block to the next in each buffer (default
                ``spec.buffer_block_bytes``; larger: padding after each block), a
                multiple of the element size.
        Raises:
            ValueError: wrong buffer count, non-contiguous, mixed devices, too small, or a
                stride smaller than a block or not a multiple of the element size.
        """
        if len(buffers) != spec.num_buffers:
            raise ValueError(f"{spec.layout} layout needs {spec.num_buffers} buffer(s), "
                             f"got {len(buffers)}")
        if any(not b.is_contiguous() for b in buffers):
            raise ValueError("KV buffers must be contiguous")
        if len({b.device for b in buffers}) != 1:
            raise ValueError("KV buffers must all be on one device")
        block = spec.buffer_block_bytes
        stride = block if block_stride is None else block_stride
        if stride < block or stride % spec.elem_bytes:
            raise ValueError(f"a block stride of {stride} bytes does not hold blocks of "
                             f"{block} bytes of {spec.dtype}")
        fit = min(b.numel() * b.element_size() for b in buffers) // stride
        num_blocks = fit if num_blocks is None else num_blocks
        if num_blocks > fit or num_blocks < 1:
            raise ValueError(f"KV buffers hold {fit} block(s) of {stride} "
                             f"bytes; {num_blocks} requested")
        shape = _buffer_shape(spec, num_blocks)
        typed = [b.reshape(-1).view(torch.uint8)[:num_blocks * stride]
                 .view(num_blocks, stride)[:, :block].view(spec.dtype).view(shape)
                 for b in buffers]
        return cls(spec, typed, num_blocks)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.block_bytes

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device


def _buffer_shape(spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
    if spec.layout == "block_major":
        return (num_blocks, spec.num_layers, 2, *spec.layer_block_shape)
    return (num_blocks, *spec.layer_block_shape)


def _views(spec: KVCacheSpec, bufs: list[torch.Tensor], n: int
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if spec.layout == "block_major":
        (b,) = bufs
        assert b.shape == _buffer_shape(spec, n)
        return [(b[:, i, 0], b[:, i, 1]) for i in range(spec.num_layers)]
    assert all(b.shape == _buffer_shape(spec, n) for b in bufs)
    return [(bufs[2 * i], bufs[2 * i + 1]) for i in range(spec.num_layers)]
