"""Tensor parallelism in the bundled engine (issue 26, scope 3).

* every rank's share of a model (threads of this process, :mod:`tp_threads`) gives the
  logits of the whole model: llama, qwen2 (q/k/v biases), qwen3 (q/k norms, tied
  embeddings), and a llama with biases on every projection (o_proj's, row-parallel,
  added once);
* the loader reads each rank's slices;
* one real TP=2 engine (rank 1 a process, gloo) generates the TP=1 engine's greedy tokens
  through chunked prefill, decode and prefix-cache hits; its KV cache holds its heads;
* refusals are one line: a model that does not split, what TP does not combine with;
* a rank killed with SIGKILL makes the next step fail with one line, not hang.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kvpool.cli.main import cli
from kvpool.engine import LLM, CheckpointError, SamplingParams
from kvpool.engine.tp.collective import SINGLE
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine.model.loader import load_model
from kvpool.engine.model.config import ModelConfig
from kvpool.engine.model_runner import ModelRunner
from kvpool.engine.step_input import StepEntry
from kvpool.engine.model.tiny import make_tiny_model
from kvpool.engine.tp.layers import Cut, RowParallelLinear, cut_of

from .helpers import prompts
from .tp_threads import ThreadGroup, ThreadRank

BS = 16


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    out = {a: make_tiny_model(root / a, layers=2, hidden=128, heads=4, kv_heads=2,
                              vocab=512, arch=a, seed=3) for a in ("llama", "qwen2", "qwen3")}
    out["llama_bias"] = _with_biases(out["llama"], root / "llama_bias")
    return out


def _with_biases(src: Path, dst: Path) -> Path:
    """``src`` with ``attention_bias`` true: random q/k/v/o biases."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["attention_bias"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for key in list(w):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if key.endswith(f"self_attn.{proj}.weight"):
                w[key.replace(".weight", ".bias")] = torch.randn(
                    w[key].shape[0], generator=g) * 0.5
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _runner(path: Path, tp=SINGLE) -> ModelRunner:  # noqa: ANN001
    mc = ModelConfig.from_dir(path)
    model = load_model(path, torch.device("cpu"), torch.float32, mc, tp)
    heads = model.num_local_heads[1]
    kv = KVCache.allocate(KVCacheSpec(mc.num_layers, BS, heads, mc.head_dim, torch.float32),
                          16, torch.device("cpu"))
    return ModelRunner(model, kv, BS, torch.device("cpu"), torch.float32)


def _forced_steps(prompt: list[int], new: int) -> list[list[StepEntry]]:
    """A prefill in two chunks, then ``new`` decodes of fixed tokens (teacher forcing:
    every engine runs the same entries)."""
    tokens = prompt + [(7 * i + 11) % 500 + 3 for i in range(new)]
    half = len(prompt) // 2

    def entry(start: int, end: int) -> StepEntry:
        return StepEntry(start, tokens[start:end], list(range(1, -(-end // BS) + 1)),
                         end >= len(prompt))

    steps = [[entry(0, half)], [entry(half, len(prompt))]]
    steps += [[entry(p, p + 1)] for p in range(len(prompt), len(tokens) - 1)]
    return steps


def _logits(runner: ModelRunner, steps: list[list[StepEntry]]) -> list[torch.Tensor | None]:
    return [runner.execute(s) for s in steps]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama_bias"])
def test_every_rank_share_gives_the_whole_model_logits(tiny_models, arch):
    path = tiny_models[arch]
    steps = _forced_steps(prompts((37,), seed=4)[0], 6)
    want = _logits(_runner(path), steps)

    def rank(r: ThreadRank) -> list[torch.Tensor | None]:
        return _logits(_runner(path, r), steps)

    got = ThreadGroup(2).run(rank)
    assert all(x is None for x in got[1]), "only rank 0 gets the logits"
    for w, g in zip(want, got[0]):
        assert w is not None and g is not None and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist()


def test_loader_reads_each_rank_slices(tiny_models):
    path = tiny_models["llama_bias"]
    mc = ModelConfig.from_dir(path)
    cpu, f32 = torch.device("cpu"), torch.float32
    whole = load_model(path, cpu, f32, mc)
    group = ThreadGroup(2)  # loading calls no collective: the ranks load one after another
    shares = [load_model(path, cpu, f32, mc, group.rank(r)) for r in range(2)]
    d, h, kvh = mc.head_dim, mc.num_heads, mc.num_kv_heads
    wq = whole.model.layers[0].self_attn.qkv_proj.weight
    q, k = wq[:h * d], wq[h * d:(h + kvh) * d]
    for r, m in enumerate(shares):
        att = m.model.layers[0].self_attn
        lq = att.qkv_proj.weight
        torch.testing.assert_close(lq[:h * d // 2], q[r * h * d // 2:(r + 1) * h * d // 2])
        torch.testing.assert_close(lq[h * d // 2:(h + kvh) * d // 2],
                                   k[r * kvh * d // 2:(r + 1) * kvh * d // 2])
        wo = whole.model.layers[0].self_attn.o_proj.weight
        torch.testing.assert_close(att.o_proj.weight, wo[:, r * h * d // 2:(r + 1) * h * d // 2])
        bias = att.o_proj.bias
        assert bias is not None
        if r == 0:
            torch.testing.assert_close(bias, whole.model.layers[0].self_attn.o_proj.bias)
        else:
            assert not bias.any(), "a row-parallel bias is added once (rank 0)"
        v = mc.vocab_size // 2
        torch.testing.assert_close(m.model.embed_tokens.weight,
                                   whole.model.embed_tokens.weight[r * v:(r + 1) * v])
        torch.testing.assert_close(m.lm_head.weight, whole.lm_head.weight[r * v:(r + 1) * v])


def test_cut_rules():
    group = ThreadGroup(2)
    row = RowParallelLinear(8, 4, True, group.rank(1))
    assert cut_of(row, "weight", 4) == Cut(1, 4, 4, 2)
    assert cut_of(row, "bias", 4) == Cut(0, 0, 4, 1, zeros=True)
    assert cut_of(RowParallelLinear(8, 4, True, group.rank(0)), "bias", 4) is None
    assert cut_of(RowParallelLinear(8, 4, True), "weight", 4) is None


# --- one real TP=2 engine (rank 1 a process) ----------------------------------------------

@pytest.fixture(scope="module")
def engines(tiny_dir):
    opts = dict(num_kv_blocks=64, max_num_batched_tokens=48, max_num_seqs=8)
    one = LLM(str(tiny_dir), **opts)
    two = LLM(str(tiny_dir), tensor_parallel_size=2, **opts)
    yield one, two
    two.close()
    one.close()


def test_tp2_greedy_tokens_equal_tp1(engines):
    one, two = engines
    ps = prompts((5, 40, 70, 23))
    hit = [ps[2][:50] + ps[0]]  # after them: three blocks of prompt 2 in the prefix cache
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)
    want = one.generate(ps, sp) + one.generate(hit, sp)
    got = two.generate(ps, sp) + two.generate(hit, sp)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    for w, g in zip(want, got):
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits),
                                   rtol=1e-4, atol=1e-4)
    assert got[-1].num_prefix_hit_tokens >= 48
    e = two.engine
    assert e.kv_spec.num_kv_heads == 1 and one.engine.kv_spec.num_kv_heads == 2
    assert e.kv_spec.block_bytes * 2 == one.engine.kv_spec.block_bytes


def test_model_that_does_not_split_is_refused_in_one_line(tiny_dir):
    with pytest.raises(CheckpointError) as e:
        LLM(str(tiny_dir), tensor_parallel_size=3, num_kv_blocks=8)
    assert "do not divide by tensor_parallel_size 3" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("extra, needle", [
    (["--pd"], "does not combine with --pd / --role"),
    (["--weights", "pool"], "--weights pool is not supported"),
    (["--sleepable"], "does not combine with --sleep-after / --sleepable"),
    (["--tensor-parallel-size", "3"], "do not divide by tensor_parallel_size 3"),
])
def test_serve_refusals_are_one_line(tiny_dir, extra, needle):
    args = ["serve", str(tiny_dir), "--tensor-parallel-size", "2", *extra]
    r = CliRunner().invoke(cli, args, env={"KVPOOL_ENABLE": None})
    assert r.exit_code != 0
    assert needle in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_killed_rank_fails_the_next_step_in_one_line(engines):
    """Last in the module: it breaks the TP=2 engine."""
    _, two = engines
    workers = two.engine.workers
    assert workers is not None and len(workers.procs) == 1
    os.kill(workers.procs[0].pid, signal.SIGKILL)
    workers.procs[0].wait(60)
    with pytest.raises(RuntimeError) as e:
        two.generate(prompts((9,))[0], SamplingParams(temperature=0, max_tokens=3))
    assert "tensor-parallel rank 1" in str(e.value) and "\n" not in str(e.value)
    for rid in list(two.engine.requests):  # the failed step left its request: end it
        two.engine.abort(rid)
    # served, the broken engine answers 503 (not 500), and so does /health from then on
    from fastapi.testclient import TestClient

    from kvpool.engine.serving.async_engine import AsyncEngine
    from kvpool.engine.serving.server import create_app

    aengine = AsyncEngine(two.engine)
    aengine.start()
    try:
        with TestClient(create_app(aengine)) as client:
            assert client.get("/health").status_code == 200
            body = {"prompt": prompts((7,))[0], "max_tokens": 3, "temperature": 0}
            for _ in range(2):  # the step that finds the rank gone, then the gate
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 503, r.text
                assert "tensor-parallel rank 1" in r.json()["error"]["message"]
            r = client.get("/health")
            assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"]
    finally:
        aengine.stop()
