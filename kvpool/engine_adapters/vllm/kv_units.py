"""vLLM's KV cache config in whole, small allocation units (the ``get_kv_cache_configs`` seam).

vLLM 0.32 lays a plain decoder's KV out layer-outer (``LBHNC``, the CPU backend's only
layout): one ``KVCacheTensor`` whose layer ``l`` page of block ``b`` sits at
``l * layer_stride + b * block_stride``, each layer a region of its own. A kvpool unit
is one page of every region, so a chunk is ``lcm(page, layer page)`` in *each* layer:
SmolLM2-135M (30 layers, 96 KiB layer pages of 128 tokens in bfloat16) maps
30 x 6 MiB = 180 MiB at a time on 2 MiB pages.

:func:`whole_chunks` rewrites the config (every worker's alike) by
:func:`kvpool.engine_adapters.kv_unit.plan_layers`:

* the layers apart (vLLM's own placement) when that unit is small, or with
  ``KVPOOL_KV_UNIT=exact``: only the block count is rounded down to whole chunks;
* else *interleaved*: every layer's page of a block side by side in one region
  (``layer_stride`` = the layer page, ``block_stride`` = the padded block of all layers),
  which vLLM's own ``create_kv_cache_views`` turns into the same per-layer ``[B, H, N, C]``
  views, strided in ``B``: SmolLM2's 2880 KiB block padded to 3 MiB, 6 MiB units of
  2 blocks (256 tokens), 1/16 of each block unused. The block count is what the same
  memory holds in whole chunks.

Only a config of one tensor (one group, one spec: a plain decoder) is interleaved; any
other keeps vLLM's placement with whole chunks. The bridge reads the placement back from
the tensors (:meth:`~kvpool.engine_adapters.vllm.bridge.VllmBridge.allocate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpool.engine_adapters import kv_unit
from kvpool.engine_adapters.vllm.settings import AdapterError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

#: vLLM's ``get_kv_cache_configs`` with its first argument (the config) and the KV
#: specs bound: available memory per worker -> one KV cache config per worker
Configure = Callable[[list[int]], "list[KVCacheConfig]"]


def layer_outer(t: KVCacheTensor) -> bool:
    """Whether ``t`` gives each of its layers a run of its own (vLLM's layer-outer
    placement: a layer's blocks lie ``block_stride`` apart inside its run), rather than
    a block holding every layer's page (block-outer: ``block_stride`` covers them all)."""
    return len(t.layers) > 1 and t.block_stride < t.layer_stride * len(t.layers)


def placement(t: KVCacheTensor, page_size: int, pad: bool) -> kv_unit.UnitPlan:
    """The unit plan for tensor ``t``'s layers: ``n_regions == len(t.layers)`` keeps
    them apart, ``1`` interleaves them (see the module)."""
    if not layer_outer(t):  # block-outer already, or one layer: one region per block run
        return kv_unit.plan(t.block_stride, page_size, 1, pad=False)
    return kv_unit.plan_layers(t.block_stride, len(t.layers), page_size, pad)


def whole_chunks(configure: Configure, available: list[int], page_size: int, pad: bool,
                 budget: int) -> list[KVCacheConfig]:
    """vLLM's configs for ``available`` bytes per worker, in whole chunks of the plan
    :func:`placement` picks (interleaved when that makes the unit small). Raises
    AdapterError when ``budget`` (the daemon's, for the message) holds no two blocks."""
    configs = configure(available)
    if not configs or not configs[0].kv_cache_tensors:
        return configs
    c = configs[0]
    tensors = c.kv_cache_tensors
    t = tensors[0]
    unit = placement(t, page_size, pad) if len(tensors) == 1 else \
        kv_unit.plan(t.block_stride, page_size, 1, pad=False)
    bpc = unit.blocks_per_chunk
    if unit.n_regions == 1 and layer_outer(t):  # interleave the layers of a block
        whole = min(a // unit.stride for a in available) // bpc * bpc
        _check_two(whole, unit, budget)
        dense = t.block_stride * len(t.layers)  # vLLM's bytes per block, unpadded
        configs = configure([whole * dense] * len(available))
        return [_interleaved(x, unit) for x in configs]
    if c.num_blocks % bpc == 0:
        return configs
    per_block = t.size // c.num_blocks
    whole = c.num_blocks // bpc * bpc
    _check_two(whole, unit, budget)
    return configure([whole * per_block] * len(available))


def _check_two(whole: int, unit: kv_unit.UnitPlan, budget: int) -> None:
    if whole < 2:
        raise AdapterError(f"kvpool: the KV budget ({budget} B) is smaller than one chunk "
                           f"of {unit.blocks_per_chunk} KV blocks ({unit.unit_bytes} B)")


def _interleaved(c: KVCacheConfig, unit: kv_unit.UnitPlan) -> KVCacheConfig:
    """``c`` (one layer-outer tensor) with its layers side by side in each block,
    ``unit.stride`` bytes per block."""
    (t,) = c.kv_cache_tensors
    page = t.block_stride
    if c.num_blocks % unit.blocks_per_chunk or unit.block != page * len(t.layers):
        raise AdapterError(f"kvpool: vLLM sized {c.num_blocks} KV blocks of "
                           f"{len(t.layers)} x {page} B, not whole chunks of "
                           f"{unit.blocks_per_chunk} blocks of {unit.block} B")
    one = replace(t, size=c.num_blocks * unit.stride, layer_stride=page,
                  block_stride=unit.stride, offset=0)
    return replace(c, kv_cache_tensors=[one])


def chunk_units(block_stride: int, page_size: int) -> int:
    """Units (pages per region) of one chunk of blocks ``block_stride`` apart."""
    return math.lcm(page_size, block_stride) // page_size
