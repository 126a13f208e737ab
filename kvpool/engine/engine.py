"""Engine: the step-level API (add_request / step / abort / has_unfinished / close).

Single-threaded by contract: one thread (the offline ``LLM`` or the server's step loop)
owns an Engine and calls all of its methods. The one exception is ``step_lock``: every
step, admission and abort holds it, so another thread (an elastic pool giving memory
back, a handoff) can act between two steps by holding it.

Tensor parallelism (``EngineConfig.tensor_parallel_size`` > 1, CPU): this process is
rank 0: it schedules, samples and owns the block pool; :class:`~kvpool.engine.tp.workers.
TPWorkers` runs the other ranks, each with its share of the weights and of every KV block
(its KV heads), following rank 0's block tables step by step. The KV storage here (and
``kv_spec``) holds rank 0's heads only.

Handing requests between engines (prefill/decode, warm restart): ``detach`` /
``detach_all`` take requests out of scheduling with their blocks, ``reattach`` puts them
back, ``drop_detached`` ends them here, ``add_prefilled`` / ``add_adopted`` adopt one
another engine computed. Invariant: a detached request is in ``engine.detached`` only
(not in ``requests`` nor the scheduler) and still holds its blocks (ref counted by
``check_integrity``); a detached waiting request holds none.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.engine.block_pool import BlockPool, FixedBlockPool
from kvpool.engine.tp.collective import SINGLE, Collective
from kvpool.engine.config import EngineConfig
from kvpool.engine.seams import NO_SEAMS, EngineSeams
from kvpool.engine.errors import CheckpointError, RequestError
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.kv_events import KVEventCollector, KVEventsConfig, ZmqKVEventPublisher
from kvpool.engine.model.loader import load_model
from kvpool.engine.model.config import ModelConfig
from kvpool.engine.model_runner import ModelRunner
from kvpool.engine.request import Request, RequestOutput, RequestStatus
from kvpool.engine.sampling import SamplingParams, sample
from kvpool.engine.scheduler import Scheduler
from kvpool.engine.tokenizer import MAX_CHARS_PER_TOKEN, Tokenizer
from kvpool.engine.tp.layers import check_divisible
from kvpool.engine.tp.workers import TPWorkers

DEFAULT_KV_CACHE_SIZE = 256 << 20


class Engine:
    """Loads the model, owns the KV cache, pool, scheduler and requests.

    ``seams`` (:class:`~kvpool.engine.seams.EngineSeams`, default none) are the hooks an
    adapter plugs in; ``block_pool`` / ``kv_cache`` override its ``block_pool_factory`` /
    ``kv_cache_factory``; the KV storage must hold ``block_pool.capacity`` blocks.
    Once built, the engine binds itself to its pool (:meth:`BlockPool.bind_engine`: the
    pool sees it as a :class:`~kvpool.engine.block_pool.PoolUser`) and :meth:`close`
    closes the pool (and stops the other ranks of a tensor-parallel engine). Handing
    requests to another engine: see the module.

    Raises (besides the loader's CheckpointError): CheckpointError for a model that does
    not split ``tensor_parallel_size`` ways, ValueError for tensor parallelism off CPU or
    with a ``model_factory``, RuntimeError when another rank could not start.
    """

    def __init__(self, config: EngineConfig, seams: EngineSeams = NO_SEAMS, *,
                 block_pool: BlockPool | None = None, kv_cache: KVCache | None = None
                 ) -> None:
        #: held for each step, admission and abort (see the module)
        self.step_lock = threading.RLock()
        self.config = config
        self.seams = seams
        self.device = resolve_device(config.device)
        path = Path(config.model)
        self.model_config = ModelConfig.from_dir(path)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        #: the other ranks (None without tensor parallelism)
        self.workers: TPWorkers | None = None
        if config.tensor_parallel_size > 1:
            self.workers = self._start_workers()
        try:
            self._build(config, path, block_pool, kv_cache)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise

    def _start_workers(self) -> TPWorkers:
        c, size, seams = self.config, self.config.tensor_parallel_size, self.seams
        why = check_divisible(self.model_config, size)
        if why is not None:
            raise CheckpointError(f"{c.model}: {why}")
        if self.device.type != "cpu":
            raise ValueError(f"tensor parallelism runs on cpu (gloo), not {self.device}")
        if seams.model_factory is not None:
            raise ValueError("tensor_parallel_size > 1: every rank loads its own share of "
                             "the checkpoint (no model_factory)")
        workers = TPWorkers.start(c, seams.tp_rank_module, self.device, self.dtype)
        if seams.tp_started is not None:
            try:
                seams.tp_started(workers)
            except BaseException:
                workers.close()
                raise
        return workers

    def _build(self, config: EngineConfig, path: Path, block_pool: BlockPool | None,
               kv_cache: KVCache | None) -> None:
        tp: Collective = SINGLE if self.workers is None else self.workers.group
        seams = self.seams
        if self.workers is None:
            self.model = (seams.model_factory or load_model)(path, self.device, self.dtype,
                                                              self.model_config)
        else:
            self.model = load_model(path, self.device, self.dtype, self.model_config, tp)
        self.tokenizer = Tokenizer.from_dir(path)
        self.served_model_name = config.served_model_name or path.resolve().name
        mc = self.model_config
        layout = config.kv_layout
        if layout == "auto":  # DESIGN.md: per-layer buffers on GPUs (page-local reads)
            layout = "per_layer" if self.device.type == "cuda" else "block_major"
        self.kv_spec = KVCacheSpec(mc.num_layers, config.block_size,
                                   mc.num_kv_heads // tp.size, mc.head_dim, self.dtype, layout)
        num_blocks = config.num_kv_blocks or max(
            2, int(config.kv_cache_size or DEFAULT_KV_CACHE_SIZE) // self.kv_spec.block_bytes)
        if block_pool is None:
            block_pool = (seams.block_pool_factory or FixedBlockPool)(num_blocks)
        if kv_cache is None:
            kv_cache = (seams.kv_cache_factory or KVCache.allocate)(
                self.kv_spec, block_pool.capacity, self.device)
        assert kv_cache.num_blocks >= block_pool.capacity, "KV storage smaller than the pool"
        self.pool, self.kv_cache = block_pool, kv_cache
        if self.workers is not None:
            self.workers.setup(kv_cache.num_blocks, layout)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings,
                                 (block_pool.capacity - 1) * config.block_size)
        self.kv_manager = KVCacheManager(block_pool, config.block_size,
                                         config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_batched_tokens,
                                   config.max_num_seqs)
        self.runner = ModelRunner(self.model, kv_cache, config.block_size, self.device,
                                  self.dtype, config.attention_backend,
                                  config.max_num_batched_tokens, prepack=self._prepack(),
                                  followers=self.workers)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= self.tokenizer.eos_token_ids
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._finished: collections.deque[Request] = collections.deque(maxlen=1000)
        #: requests whose KV is being handed to another engine (they hold their blocks)
        self.detached: dict[str, Request] = {}
        self.counters = collections.Counter[str]()
        #: the KV events publisher (None without ``kv_events_config``)
        self.kv_events = self._start_kv_events(block_pool)
        block_pool.bind_engine(self)

    def _start_kv_events(self, pool: BlockPool) -> ZmqKVEventPublisher | None:
        text = self.config.kv_events_config
        if text is None or not self.config.enable_prefix_caching:
            return None
        events = KVEventsConfig.parse(text)
        if not events.active:
            return None
        collector = KVEventCollector(events.max_queue_size)
        pool.bind_events(collector, self.config.block_size)
        return ZmqKVEventPublisher(events, collector)

    def _prepack(self) -> bool:
        """Whether the model's fp32 weights get a private oneDNN copy: asked, not set,
        once the model is built (shared weights never get one)."""
        shared = self.seams.weights_shared
        return self.config.prepack and not (shared is not None and shared())

    def close(self) -> None:
        """Give the KV memory back (the pool's :meth:`~BlockPool.close`: an elastic pool
        ends its tenant and threads) and stop the other ranks; the engine must not step
        again. Idempotent. The KV events end with ``AllBlocksCleared``."""
        self.pool.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.workers is not None:
            self.workers.close()

    # --- requests ---------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a prompt (text, or token ids); returns its request id.

        Raises:
            RequestError: empty or too long prompt, token ids outside the vocabulary, text
                without a tokenizer, or a duplicate request id.
        """
        with self.step_lock:
            return self._add_request(prompt, params, request_id, arrival_time)

    def _add_request(self, prompt: str | list[int], params: SamplingParams | None,
                     request_id: str | None, arrival_time: float | None) -> str:
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; the context holds "
                               f"{self.max_model_len} (max_model_len), including the output")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"duplicate request id {rid!r}")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(rid, ids, params, gen, arrival_time)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids; RequestError (one line) when it has none, an id is out
        of the vocabulary, or text is longer than the context could hold
        (``MAX_CHARS_PER_TOKEN`` characters a token: refused before tokenizing). Takes
        time in proportion to the text: servers call it off their event loop."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.config.model} has no tokenizer.json; "
                                   "pass token ids instead of text")
            limit = MAX_CHARS_PER_TOKEN * self.max_model_len
            if len(prompt) > limit:
                raise RequestError(f"{len(prompt)} characters is more than a context of "
                                   f"{self.max_model_len} tokens could hold (at most "
                                   f"{limit} characters)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"token ids must be in [0, {vocab})")
        if not ids:
            raise RequestError("empty prompt")
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish reason
        "abort"), or None if it is unknown or already finished."""
        with self.step_lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return None
            self.scheduler.finish(req, "abort")
            self._finished.append(req)
            self.counters["finished"] += 1
            return self._output(req, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_steps(self) -> int:
        """Steps that ran a batch so far."""
        return self.counters["steps"]

    def preempt_until_free(self, num_blocks: int) -> int:
        """Preempt the newest running requests (they requeue and recompute later) until the
        pool reports ``num_blocks`` free or nothing runs; returns how many were preempted.
        For a memory arbiter that needs KV memory back; call between steps."""
        n = 0
        while self.scheduler.running and self.pool.get_num_free_blocks() < num_blocks:
            self.scheduler.preempt(self.scheduler.running.pop())
            n += 1
        return n

    # --- handing requests to another engine ------------------------------------------

    def detach(self, request_id: str) -> Request:
        """Take a running request out of scheduling, keeping its blocks (their bytes are
        about to change hands). Then :meth:`drop_detached` once the blocks are gone, or
        :meth:`reattach` if the handoff failed. Raises RequestError unless it is running
        with all of its tokens but the last computed (just after a step)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            raise RequestError(f"request {request_id!r} is not running")
        if req.num_computed_tokens != req.num_tokens - 1:
            raise RequestError(f"request {request_id!r} is mid-prefill")
        self.scheduler.running.remove(req)
        del self.requests[request_id]
        self.detached[request_id] = req
        return req

    def detach_all(self) -> list[Request]:
        """(just after a step) Take every request out of scheduling, running ones first
        (mid-prefill too: they keep the blocks of their computed tokens), then the
        waiting ones (no blocks), each list in its scheduling order; returns them in that
        order. :meth:`reattach` them in the same order to restore the queues."""
        reqs = [*self.scheduler.running, *self.scheduler.waiting]
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        for req in reqs:
            del self.requests[req.request_id]
            self.detached[req.request_id] = req
        return reqs

    def reattach(self, request_id: str) -> None:
        """A detached request whose handoff failed runs (or waits) here again, at the end
        of its queue (its KV is intact)."""
        req = self.detached.pop(request_id)
        self.requests[request_id] = req
        if req.status is RequestStatus.WAITING:
            self.scheduler.waiting.append(req)
        else:
            self.scheduler.running.append(req)

    def drop_detached(self, request_id: str) -> Request:
        """A detached request's blocks now belong elsewhere (the pool forgot them): it is
        over here (finish reason "handoff")."""
        req = self.detached.pop(request_id)
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = "handoff"
        return req

    def add_prefilled(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                      params: SamplingParams, block_ids: list[int],
                      output_text: str = "", detok_offsets: tuple[int, int] | None = None,
                      generator_state: torch.Tensor | None = None) -> str:
        """Adopt a request another engine prefilled: its K/V for all of ``token_ids`` but
        the last is in ``block_ids`` (blocks the pool already counts as held, ref 1), so
        it runs at once and its next step decodes; ``generator_state`` continues a seeded
        request's random stream where the other engine left it. Raises RequestError on a
        duplicate id or a block table that does not cover the tokens."""
        return self.add_adopted(request_id, token_ids, num_prompt_tokens, params, block_ids,
                                len(token_ids) - 1, output_text, detok_offsets,
                                generator_state)

    def add_adopted(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                    params: SamplingParams, block_ids: list[int], num_computed_tokens: int,
                    output_text: str = "", detok_offsets: tuple[int, int] | None = None,
                    generator_state: torch.Tensor | None = None, num_cached_blocks: int = 0,
                    num_preemptions: int = 0) -> str:
        """Adopt a request at any point another engine left it (:meth:`add_prefilled`
        generalised, for a warm restart): K/V of its first ``num_computed_tokens`` tokens
        in ``block_ids`` (held, ref counted by the caller), the first
        ``num_cached_blocks`` of them in the prefix cache. With K/V it runs at once (its
        next step decodes, or goes on prefilling); without (``num_computed_tokens == 0``,
        no blocks: it was waiting) it queues. Raises RequestError on a duplicate id or a
        block table that does not fit the tokens."""
        if request_id in self.requests or request_id in self.detached:
            raise RequestError(f"duplicate request id {request_id!r}")
        computed, bs = num_computed_tokens, self.config.block_size
        if not (0 < num_prompt_tokens <= len(token_ids) and 0 <= computed < len(token_ids)
                and len(block_ids) * bs >= computed and (computed > 0) == bool(block_ids)
                and len(block_ids) <= -(-len(token_ids) // bs)
                and 0 <= num_cached_blocks <= computed // bs):
            raise RequestError(f"request {request_id!r}: block table does not cover it")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            if generator_state is not None:
                gen.set_state(generator_state)
        req = Request(request_id, token_ids[:num_prompt_tokens], params, gen)
        req.token_ids = list(token_ids)
        req.output_text = output_text
        if detok_offsets is not None:
            req.detok_offsets = (detok_offsets[0], detok_offsets[1])
        req.num_preemptions = num_preemptions
        self.requests[request_id] = req
        if not block_ids:
            self.scheduler.add(req)  # waiting: it computes (or recomputes) here
            return request_id
        req.block_ids = list(block_ids)
        req.num_computed_tokens = computed
        req.num_cached_blocks = num_cached_blocks
        req.status = RequestStatus.RUNNING
        now = time.perf_counter()
        req.metrics.first_scheduled_time = now
        if req.num_output_tokens:
            req.metrics.first_token_time = now
        self.scheduler.running.append(req)
        return request_id

    # --- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs for requests that got a
        token this step (finished ones included). Empty when nothing could be scheduled
        (e.g. an elastic pool with no memory right now)."""
        with self.step_lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        samplers, logits = self.runner.run(sched.scheduled)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
            self.kv_manager.cache_blocks(req)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += sched.num_tokens
        tokens = sample(logits, [r.params for r in samplers],
                        [r.generator or self.generator for r in samplers])
        outputs = []
        now = time.perf_counter()
        for i, (req, tok) in enumerate(zip(samplers, tokens)):
            if req.params.return_logits:
                req.logits.append(logits[i].cpu())
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                self.counters["prompt_tokens"] += req.num_prompt_tokens
                self.counters["prefix_hit_tokens"] += req.num_prefix_hit_tokens
            req.token_ids.append(tok)
            self.counters["generated_tokens"] += 1
            self._check_stop(req, tok)
            if req.finished:
                del self.requests[req.request_id]
                self._finished.append(req)
                self.counters["finished"] += 1
            outputs.append(self._output(req, [tok]))
        return outputs

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        if p.detokenize and self.tokenizer is not None:
            new, req.detok_offsets = self.tokenizer.detokenize_step(req.token_ids,
                                                                    req.detok_offsets)
            old_len = len(req.output_text)
            req.output_text += new
            for s in p.stop:
                at = req.output_text.find(s, max(0, old_len - len(s) + 1))
                if at >= 0:
                    req.output_text = req.output_text[:at]
                    return self.scheduler.finish(req, "stop")
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return self.scheduler.finish(req, "stop")
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return self.scheduler.finish(req, "length")

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        text = req.output_text
        if not req.finished and req.params.stop:
            text = text[:max(0, len(text) - max(len(s) for s in req.params.stop) + 1)]
        m = req.metrics
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
            output_token_ids=req.output_token_ids, new_token_ids=new, text=text,
            finished=req.finished, finish_reason=req.finish_reason,
            num_preemptions=req.num_preemptions, num_prefix_hit_tokens=req.num_prefix_hit_tokens,
            ttft=m.ttft, tpot=_tpot(req), logits=req.logits if req.finished else [])

    # --- introspection --------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """JSON-ready engine statistics (KV blocks, queues, preemptions, latency summary)."""
        free = self.pool.get_num_free_blocks()
        used = self.pool.num_used_blocks
        ttfts = [t for r in self._finished if (t := r.metrics.ttft) is not None]
        tpots = [t for r in self._finished if (t := _tpot(r)) is not None]
        return {
            "model": self.served_model_name,
            "kv_blocks": {"total": used + free, "used": used, "free": free,
                          "cached": self.pool.num_cached_blocks, "capacity": self.pool.capacity,
                          "block_size": self.config.block_size,
                          "block_bytes": self.kv_spec.block_bytes,
                          "usage": round(self.pool.get_usage(), 4)},
            "kv_layout": self.kv_spec.layout,
            "kv_held_bytes": self.pool.held_bytes(self.kv_spec.block_bytes),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "max_model_len": self.max_model_len,
            **{k: self.counters[k] for k in ("steps", "computed_tokens", "prompt_tokens",
                                             "prefix_hit_tokens", "generated_tokens")},
            "finished_requests": self.counters["finished"],
            "finish_reasons": dict(collections.Counter(r.finish_reason for r in self._finished)),
            "ttft_s": summarize(ttfts),
            "tpot_s": summarize(tpots),
        }

    def check_integrity(self) -> None:
        """Pool invariants, and every block's ref count equals the running requests holding
        it (waiting requests hold none)."""
        self.pool.check_integrity()
        held = collections.Counter(b for r in [*self.scheduler.running,
                                               *self.detached.values()] for b in r.block_ids)
        for r in self.scheduler.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.block_ids) * self.config.block_size >= r.num_computed_tokens
        for r in self.scheduler.waiting:
            assert not r.block_ids and r.status is RequestStatus.WAITING, f"{r} holds blocks"
        for b in range(1, self.pool.capacity):
            assert self.pool.ref_count(b) == held[b], \
                f"block {b}: ref {self.pool.ref_count(b)}, held by {held[b]} request(s)"


def _tpot(req: Request) -> float | None:
    m = req.metrics
    n = req.num_output_tokens
    if m.first_token_time is None or m.finish_time is None or n < 2:
        return None
    return (m.finish_time - m.first_token_time) / (n - 1)


def summarize(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(f: float) -> float:
        return s[min(len(s) - 1, int(f * len(s)))]

    return {"count": len(s), "mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9),
            "p99": q(0.99)}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, mc: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu" or mc.torch_dtype is None:
            return torch.float32
        dtype = mc.torch_dtype
    dt = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return dt
