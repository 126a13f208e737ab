"""EngineConfig: the one configuration object of the bundled engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from kvpool.sizes import parse_size  # shared with the CLI and the daemon; no daemon import

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from kvpool.engine.block_pool import BlockPool
    from kvpool.engine.kv_cache import KVCache, KVCacheSpec
    from kvpool.engine.model import LlamaForCausalLM
    from kvpool.engine.model_config import ModelConfig
    from kvpool.engine.tp_workers import TPWorkers

# A KV layout (kvpool.engine.kv_cache.KVLayout), or "auto": chosen from the device.
KVLayoutOption = Literal["auto", "block_major", "per_layer"]

@dataclass
class EngineConfig:
    """Everything the engine needs to know; ``LLM(model, **kwargs)`` fills it from kwargs.

    KV cache size: ``num_kv_blocks`` wins over ``kv_cache_size`` (bytes or "64MiB"); with
    neither, ``kv_cache_size`` defaults to 256 MiB. The usable block count is one less than
    the allocated count because block 0 is the reserved null block.

    Extension points (used by ``kvpool.engine_adapters``): ``block_pool_factory(num_blocks)``
    returns the :class:`~kvpool.engine.block_pool.BlockPool` the scheduler allocates from and
    ``kv_cache_factory(spec, num_blocks, device)`` returns the
    :class:`~kvpool.engine.kv_cache.KVCache` storage; both default to plain preallocation.
    ``model_factory(path, device, dtype, model_config)`` builds the model with its
    parameters filled (default: :func:`kvpool.engine.loader.load_model`, private
    memory); it runs first, before both others, and must raise CheckpointError for a
    checkpoint that does not match (``kvpool.engine.loader``'s checks). ``prepack``:
    give fp32 linear layers on CPU a private oneDNN copy of their weights
    (:func:`kvpool.engine.fused.prepack`: faster GEMMs at 5-256 rows, one more copy of
    those weights in memory); a model whose weights are shared turns it off.

    ``tensor_parallel_size`` > 1 (CPU): the model is split over that many processes
    (this one is rank 0: :mod:`kvpool.engine.tp_workers`); heads, KV heads, the MLP and
    the vocabulary must divide by it. Each rank holds its KV heads of every block, so
    the KV sizes above (and ``block_pool_factory`` / ``kv_cache_factory``) are rank 0's.
    Every rank loads its own share, so ``model_factory`` must be None. Adapter seams:
    ``tp_rank_module`` is the module each other rank runs (``python -m``; an adapter's
    calls :func:`kvpool.engine.tp_rank.main` with its own hooks) and
    ``tp_started(workers)`` is called once they joined, before the model loads and
    before the factories run (the adapter keeps the handle to post its messages).
    """

    model: str
    device: str = "auto"  # "auto": cuda if available, else cpu
    # "auto": float32 on cpu, the checkpoint's dtype on accelerators. "bfloat16" on cpu:
    # weights and KV blocks at half the bytes, the native kernels in their bf16 variants
    # (docs/ENGINE-ATTENTION.md says what that costs)
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_size: int | str | None = None
    num_kv_blocks: int | None = None
    kv_layout: KVLayoutOption = "auto"  # "auto": per_layer on CUDA, block_major elsewhere
    max_num_batched_tokens: int = 512  # per-step token budget: decodes + prefill chunks
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # "auto": the native in-place paged kernel on CPU/float32|bfloat16, gather + SDPA elsewhere
    attention_backend: Literal["auto", "native", "torch"] = "auto"
    seed: int = 0  # seeds the generator that unseeded sampling requests use
    served_model_name: str | None = None
    block_pool_factory: Callable[[int], BlockPool] | None = None
    kv_cache_factory: Callable[[KVCacheSpec, int, torch.device], KVCache] | None = None
    model_factory: Callable[[Path, torch.device, torch.dtype, ModelConfig],
                            LlamaForCausalLM] | None = None
    prepack: bool = True
    tensor_parallel_size: int = 1
    tp_rank_module: str = "kvpool.engine.tp_rank"
    tp_started: Callable[[TPWorkers], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, for adapters

    def __post_init__(self) -> None:
        assert self.block_size > 0, "block_size must be positive"
        assert self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive"
        assert self.max_num_seqs > 0, "max_num_seqs must be positive"
        assert self.kv_layout in ("auto", "block_major", "per_layer"), f"bad kv_layout {self.kv_layout}"
        assert self.attention_backend in ("auto", "native", "torch"), \
            f"bad attention_backend {self.attention_backend}"
        assert self.num_kv_blocks is None or self.num_kv_blocks >= 2, "need >= 2 KV blocks"
        assert self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"
        if self.kv_cache_size is not None:
            self.kv_cache_size = parse_size(self.kv_cache_size)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but names the unknown keys instead of a bare TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
