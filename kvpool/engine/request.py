"""Request: one generation's state as it moves through waiting -> running -> finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvpool.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted (KV freed, will recompute)
    RUNNING = "running"  # holds KV blocks
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


class Request:
    """Token state: ``token_ids = prompt + output``; the first ``num_computed_tokens`` of
    them have K/V in ``block_ids``. There is no prefill/decode phase: a request just has
    ``num_computed_tokens`` catching up with ``num_tokens``.

    Invariants: ``len(block_ids) * block_size >= num_computed_tokens``; the first
    ``num_cached_blocks`` blocks are registered in the prefix cache; a WAITING request
    holds no blocks.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0
        self.block_hashes: list[int] = []  # chained hashes of full blocks, grown lazily
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.metrics = RequestMetrics(time.perf_counter() if arrival_time is None
                                      else arrival_time)
        self.output_text = ""
        self.detok_offsets = (max(self.num_prompt_tokens - 5, 0), self.num_prompt_tokens)
        self.logits: list[torch.Tensor] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def block_hash(self, i: int, block_size: int) -> int:
        """Chained hash of full block ``i``: hash(previous hash, this block's tokens)."""
        while len(self.block_hashes) <= i:
            j = len(self.block_hashes)
            prev = self.block_hashes[-1] if j else 0
            self.block_hashes.append(hash((prev, tuple(self.block_tokens(j, block_size)))))
        return self.block_hashes[i]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step (new tokens and/or finishing).

    ``text`` is the detokenized output so far; while unfinished it holds back a tail that
    could still turn into a stop string or an incomplete UTF-8 character.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
