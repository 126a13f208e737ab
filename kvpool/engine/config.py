"""EngineConfig: the one configuration object of the bundled engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from kvpool.sizes import parse_size  # shared with the CLI and the daemon; no daemon import

# A KV layout (kvpool.engine.kv_cache.KVLayout), or "auto": chosen from the device.
KVLayoutOption = Literal["auto", "block_major", "per_layer"]


class EngineConfigError(ValueError):
    """An engine option out of range: one line naming it."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know; ``LLM(model, **kwargs)`` fills it from kwargs.

    KV cache size: ``num_kv_blocks`` wins over ``kv_cache_size`` (bytes or "64MiB"); with
    neither, ``kv_cache_size`` defaults to 256 MiB. The usable block count is one less than
    the allocated count because block 0 is the reserved null block.

    Frozen values: a variant is ``dataclasses.replace(config, ...)``. The hooks an
    adapter plugs in (factories, ``tp_started``, the rank module) are not here but in
    :class:`~kvpool.engine.seams.EngineSeams`, passed to the engine alongside.
    ``prepack``: give fp32 linear layers on CPU a private oneDNN copy of their weights
    (:func:`kvpool.engine.model.fused.prepack`: faster GEMMs at 5-256 rows, one more copy of
    those weights in memory); weights the seams share are never prepacked.

    ``tensor_parallel_size`` > 1 (CPU): the model is split over that many processes
    (this one is rank 0: :mod:`kvpool.engine.tp.workers`); heads, KV heads, the MLP and
    the vocabulary must divide by it. Each rank holds its KV heads of every block, so
    the KV sizes above (and the seams' factories) are rank 0's.

    Raises :class:`EngineConfigError` (a ValueError) for a value out of range.
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
    prepack: bool = True
    tensor_parallel_size: int = 1
    #: vLLM's ``--kv-events-config`` JSON (:mod:`kvpool.engine.kv_events`); None: no events
    kv_events_config: str | None = None

    def __post_init__(self) -> None:
        _check(self.block_size > 0, "block_size must be positive")
        _check(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")
        _check(self.max_num_seqs > 0, "max_num_seqs must be positive")
        _check(self.kv_layout in ("auto", "block_major", "per_layer"),
               f"bad kv_layout {self.kv_layout!r}")
        _check(self.attention_backend in ("auto", "native", "torch"),
               f"bad attention_backend {self.attention_backend!r}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "need >= 2 KV blocks")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        if self.kv_events_config is not None:
            from kvpool.engine.kv_events import KVEventsConfig, KVEventsConfigError

            try:
                KVEventsConfig.parse(self.kv_events_config)
            except KVEventsConfigError as e:
                raise EngineConfigError(str(e)) from None
        if self.kv_cache_size is not None:  # frozen: the parsed size replaces the text
            object.__setattr__(self, "kv_cache_size", parse_size(self.kv_cache_size))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but names the unknown keys instead of a bare TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


def _check(ok: bool, why: str) -> None:
    if not ok:
        raise EngineConfigError(why)
