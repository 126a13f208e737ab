"""LLM: offline batch generation on top of the step-level Engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM(model_dir, **engine_options).generate(prompts, SamplingParams(...))``.

    Engine options are the fields of :class:`EngineConfig`; ``block_pool`` / ``kv_cache``
    are passed to :class:`Engine`.
    """

    def __init__(self, model: str, *, block_pool: Any = None, kv_cache: Any = None,
                 **kwargs: Any) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(model, **kwargs),
                             block_pool=block_pool, kv_cache=kv_cache)

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        assert len(params) == len(prompts), "one SamplingParams per prompt"
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
