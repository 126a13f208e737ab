"""Preemption by recompute: a KV cache too small for the load still finishes every
request with the output of an unconstrained run."""

from __future__ import annotations

from kvpool.engine import LLM, Engine, EngineConfig, FixedBlockPool, PoolExhausted, \
    SamplingParams

from .helpers import prompts

LENGTHS = (20, 33, 27, 40, 24, 31)


def _params():
    # greedy and seeded sampling both must survive recomputation
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True)
            for i in range(len(LENGTHS))]


def _outputs(path, num_kv_blocks, **kw):
    llm = LLM(str(path), num_kv_blocks=num_kv_blocks, block_size=4, **kw)
    return llm, llm.generate(prompts(LENGTHS, seed=5), _params())


def test_small_cache_preempts_and_matches(hf_dirs):
    _, free = _outputs(hf_dirs["llama"], 256)
    llm, tight = _outputs(hf_dirs["llama"], 20)  # 19 usable blocks = 76 tokens
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0
    assert sum(o.num_preemptions for o in tight) == stats["preemptions"]
    assert [o.output_token_ids for o in tight] == [o.output_token_ids for o in free]
    assert all(o.finish_reason == "length" for o in tight)
    assert stats["kv_blocks"]["used"] == 0 and stats["running"] == stats["waiting"] == 0


def test_integrity_holds_at_every_step(hf_dirs):
    eng = Engine(EngineConfig(str(hf_dirs["llama"]), num_kv_blocks=20, block_size=4,
                              max_num_batched_tokens=16))
    for p, sp in zip(prompts(LENGTHS, seed=5), _params()):
        eng.add_request(p, sp)
    finished = 0
    while eng.has_unfinished():
        finished += sum(o.finished for o in eng.step())
        eng.check_integrity()
    assert finished == len(LENGTHS) and eng.scheduler.num_preemptions > 0


class FlakyPool(FixedBlockPool):
    """Refuses every third allocation although blocks are free, as an elastic pool whose
    memory was just reclaimed would: the engine must preempt/wait, not crash."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.calls = 0

    def get_new_blocks(self, n: int) -> list[int]:
        self.calls += 1
        if n and self.calls % 3 == 0:
            raise PoolExhausted("reclaimed")
        return super().get_new_blocks(n)


def test_pool_failing_despite_free_blocks(hf_dirs):
    _, ref = _outputs(hf_dirs["llama"], 256)
    llm, outs = _outputs(hf_dirs["llama"], 64, block_pool_factory=FlakyPool)
    assert isinstance(llm.engine.pool, FlakyPool) and llm.engine.pool.calls > 0
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]


def test_preempt_until_free_from_outside(hf_dirs):
    """What a memory arbiter does between steps: take KV back, requests still finish
    with the same output."""
    _, ref = _outputs(hf_dirs["llama"], 256)
    eng = Engine(EngineConfig(str(hf_dirs["llama"]), num_kv_blocks=256, block_size=4))
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts(LENGTHS, seed=5), _params())]
    for _ in range(3):
        eng.step()
    assert eng.preempt_until_free(eng.pool.capacity - 1) == len(LENGTHS)
    assert eng.pool.num_used_blocks == 0
    eng.check_integrity()
    done = {}
    while eng.has_unfinished():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert [done[i].output_token_ids for i in ids] == [o.output_token_ids for o in ref]
    assert all(done[i].num_preemptions == 1 for i in ids)
