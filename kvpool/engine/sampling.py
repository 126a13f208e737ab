"""SamplingParams and the sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvpool.engine.model import fused
from kvpool.engine.errors import RequestError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy; ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` gives the request its own generator, so its samples do not depend on what else
    is in the batch. Generation stops at ``max_tokens``, at a token in ``stop_token_ids``,
    at the model's EOS (unless ``ignore_eos``) or when the text contains a ``stop`` string
    (the string is cut from the text; the tokens stay). ``return_logits`` attaches the
    float32 logits row each token was sampled from (for tests and debugging).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True
    return_logits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, "
                               f"got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -2 ** 63 <= self.seed < 2 ** 63):
            raise RequestError(f"seed must be a signed 64-bit integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s
                                                  for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be token ids (integers >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` [S, V] (float32)."""
    out = fused.argmax(logits)
    if all(p.greedy for p in params):
        return out
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, g)
    return out


def _sample_row(x: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
    x = x / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > p.top_p  # keeps the smallest set reaching top_p
        probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=g).item())
