"""LLM: offline batch generation on top of the step-level Engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvpool.engine.block_pool import BlockPool
from kvpool.engine.config import EngineConfig
from kvpool.engine.seams import EngineSeams
from kvpool.engine.engine import Engine
from kvpool.engine.kv_cache import KVCache
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """``LLM(model_dir, **engine_options).generate(prompts, SamplingParams(...))``.

    Engine options are the fields of :class:`EngineConfig` (``tensor_parallel_size=2``
    splits the model over two processes) and of
    :class:`~kvpool.engine.seams.EngineSeams` (``kv_cache_factory=`` ...); ``block_pool``
    / ``kv_cache`` are passed to
    :class:`Engine`. :meth:`close` when done (a tensor-parallel engine's other ranks
    also end with this process).
    """

    def __init__(self, model: str, *, block_pool: BlockPool | None = None,
                 kv_cache: KVCache | None = None, **kwargs: Any) -> None:
        hooks = {k: kwargs.pop(k) for k in EngineSeams.names() & set(kwargs)}
        self.engine = Engine(EngineConfig.from_kwargs(model, **kwargs), EngineSeams(**hooks),
                             block_pool=block_pool, kv_cache=kv_cache)

    def close(self) -> None:
        """The engine's :meth:`~kvpool.engine.engine.Engine.close` (gives the KV memory
        back; stops the other ranks of a tensor-parallel engine). Idempotent."""
        self.engine.close()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        batch = _batch(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(batch)
        assert len(params) == len(batch), "one SamplingParams per prompt"
        ids = [self.engine.add_request(p, sp) for p, sp in zip(batch, params)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


def _batch(prompts: Prompt | Sequence[Prompt]) -> Sequence[Prompt]:
    """One prompt (text, or token ids) as a batch of one; a batch as it is."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]  # mypy cannot narrow a list by its first item
    return cast(Sequence[Prompt], prompts)
