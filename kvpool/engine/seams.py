"""EngineSeams: the hooks an adapter plugs into one engine, apart from its configuration.

:class:`~kvpool.engine.config.EngineConfig` is frozen values (what to run); this is how
the engine's parts are built (who builds them). ``Engine(config, seams)``; every hook is
optional and defaults to the engine's own part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from kvpool.engine.block_pool import BlockPool
    from kvpool.engine.kv_cache import KVCache, KVCacheSpec
    from kvpool.engine.model.llama import LlamaForCausalLM
    from kvpool.engine.model.config import ModelConfig
    from kvpool.engine.tp.workers import TPWorkers

DEFAULT_RANK_MODULE = "kvpool.engine.tp.rank"


@dataclass(frozen=True)
class EngineSeams:
    """The extension points of one engine (used by ``kvpool.engine_adapters``).

    ``model_factory(path, device, dtype, model_config)`` builds the model with its
    parameters filled (default: :func:`kvpool.engine.model.loader.load_model`, private memory);
    it runs first, before both others, and must raise CheckpointError for a checkpoint
    that does not match (``kvpool.engine.model.loader``'s checks). ``block_pool_factory(
    num_blocks)`` returns the :class:`~kvpool.engine.block_pool.BlockPool` the scheduler
    allocates from and ``kv_cache_factory(spec, num_blocks, device)`` the
    :class:`~kvpool.engine.kv_cache.KVCache` storage; both default to plain
    preallocation. ``weights_shared()``, asked once the model is built: True when its
    parameters are shared with other processes, so the engine gives them no private
    oneDNN copy (``EngineConfig.prepack`` is then ignored).

    Tensor parallelism: every rank loads its own share, so ``model_factory`` must be
    None. ``tp_rank_module`` is the module each other rank runs (``python -m``; an
    adapter's calls :func:`kvpool.engine.tp.rank.main` with its own hooks) and
    ``tp_started(workers)`` is called once they joined, before the model loads and
    before the factories run (the adapter keeps the handle to post its messages).

    ``adapter``: the adapter object that made these seams (one per engine), for the
    code around the engine that asks it (e.g. ``bundled.bridge_of(engine)``); the engine
    never reads it.
    """

    block_pool_factory: Callable[[int], BlockPool] | None = None
    kv_cache_factory: Callable[[KVCacheSpec, int, torch.device], KVCache] | None = None
    model_factory: Callable[[Path, torch.device, torch.dtype, ModelConfig],
                            LlamaForCausalLM] | None = None
    weights_shared: Callable[[], bool] | None = None
    tp_rank_module: str = DEFAULT_RANK_MODULE
    tp_started: Callable[[TPWorkers], None] | None = None
    adapter: object | None = None

    @classmethod
    def names(cls) -> frozenset[str]:
        """The hooks' names (``LLM(model, **kwargs)`` sends these kwargs here)."""
        return frozenset(f.name for f in dataclasses.fields(cls))


NO_SEAMS = EngineSeams()
