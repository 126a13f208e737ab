"""Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on tiny
random checkpoints written by transformers itself: same greedy tokens (logits within
1e-4), batched, with chunked prefill, with prefix-cache hits and under preemption."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from kvpool.engine import LLM, SamplingParams
from kvpool.engine.errors import CheckpointError
from kvpool.engine.model.loader import load_model
from kvpool.engine.model.config import ModelConfig
from kvpool.engine.model.moe import Experts

from .helpers import VOCAB, hf_references, load_hf, prompts

LENGTHS = (3, 16, 17, 40)  # below, at and across a block boundary (block_size 16)
NEW = 12
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def save_moe(arch: str, path: Path, *, fused: bool = False) -> Path:
    """A tiny random MoE checkpoint (~0.4M parameters) by transformers' save_pretrained:
    per-expert tensor names by default, the fused 3-D expert tensors with ``fused``."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=512,
                  num_experts_per_tok=2)
    if arch == "mixtral":  # every layer sparse, top-k always renormalised
        cfg = tf.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=32,
                               num_local_experts=8)
    elif arch == "qwen2_moe":  # shared expert; layer 1 dense (mlp_only_layers)
        cfg = tf.Qwen2MoeConfig(**common, num_hidden_layers=3, intermediate_size=96,
                                moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                num_experts=8, norm_topk_prob=False, mlp_only_layers=[1])
    else:  # q/k norm, renormalised top-k; decoder_sparse_step 2: layers 1 and 3 sparse
        cfg = tf.Qwen3MoeConfig(**common, num_hidden_layers=4, head_dim=32,
                                intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                norm_topk_prob=True, decoder_sparse_step=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(path, **({"save_original_format": False} if fused else {}))
    return path


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("moe")
    return {a: save_moe(a, root / a) for a in ARCHS}


@pytest.fixture(scope="module")
def reference(moe_dirs):
    """Per arch: transformers' greedy continuation and the logits of each of its tokens."""
    return hf_references(moe_dirs, ARCHS, LENGTHS, NEW)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, return_logits=True)


def _check(outs, ref_rows) -> None:
    for out, (ref_tokens, ref_logits) in zip(outs, ref_rows):
        assert out.output_token_ids == ref_tokens
        ours = torch.stack(out.logits)
        assert ours.shape == ref_logits.shape
        torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=0)


def test_configs_are_what_the_tests_claim(moe_dirs):
    """The tiny configs exercise what they should: sparse/dense layer layout, shared
    expert, norm_topk_prob both ways."""
    mix, q2, q3 = (ModelConfig.from_dir(moe_dirs[a]).moe for a in ARCHS)
    assert mix and q2 and q3
    assert (mix.num_experts, mix.top_k, mix.norm_topk_prob) == (8, 2, True)
    assert q2.shared_expert_intermediate_size == 48 and not q2.norm_topk_prob
    assert [q2.is_sparse(i) for i in range(3)] == [True, False, True]
    assert q3.norm_topk_prob and [q3.is_sparse(i) for i in range(4)] == [False, True] * 2


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [7, 512], ids=["c7", "whole"])
def test_matches_transformers(moe_dirs, reference, arch, chunk):
    """Four prompts of different lengths in one engine; token budget ``chunk`` (7: every
    prompt but the first is prefilled in chunks, alongside other requests' decodes)."""
    llm = LLM(str(moe_dirs[arch]), num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=chunk)
    _check(llm.generate(prompts(LENGTHS), GREEDY), reference[arch])


def test_prefix_cache_hits_and_preemption(moe_dirs, reference):
    """Prefix-cache hits (the same prompts again) and preemption (too few blocks for
    all four at once: 15 blocks of 4 tokens) leave the MoE model's tokens unchanged."""
    arch = "qwen2_moe"
    llm = LLM(str(moe_dirs[arch]), num_kv_blocks=64, block_size=16)
    _check(llm.generate(prompts(LENGTHS), GREEDY), reference[arch])
    again = llm.generate(prompts(LENGTHS), GREEDY)
    _check(again, reference[arch])
    assert [o.num_prefix_hit_tokens for o in again] == [0, 0, 16, 32]
    small = LLM(str(moe_dirs[arch]), num_kv_blocks=16, block_size=4,
                max_num_batched_tokens=16)
    _check(small.generate(prompts(LENGTHS), GREEDY), reference[arch])
    assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fused_expert_tensors_load_the_same(moe_dirs, tmp_path, arch):
    """transformers 5's fused layout (``experts.gate_up_proj`` [E, 2I, H]) and the
    per-expert names (Mixtral's w1/w2/w3 under block_sparse_moe) give the same model."""
    fused_dir = save_moe(arch, tmp_path / arch, fused=True)
    a = load_model(moe_dirs[arch], torch.device("cpu"), torch.float32).state_dict()
    b = load_model(fused_dir, torch.device("cpu"), torch.float32).state_dict()
    assert a.keys() == b.keys()
    assert any(k.endswith("mlp.experts.7.gate_up_proj.weight") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_missing_expert_is_named(moe_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(moe_dirs["mixtral"], d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): "
                       r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight"):
        load_model(d, torch.device("cpu"), torch.float32)


def test_experts_group_tokens_each_expert_runs_once():
    """The grouped forward equals a per-token reference, and calls each chosen expert once,
    on all its tokens, whatever the number of tokens."""
    torch.manual_seed(0)
    e, h, i, t, k = 6, 16, 8, 50, 2
    calls: list[int] = []

    class Expert(torch.nn.Module):
        def __init__(self, size: int) -> None:
            super().__init__()
            self.up = torch.nn.Linear(h, 2 * size, bias=False)
            self.down = torch.nn.Linear(size, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(torch.nn.functional.silu(gate) * up)

    ex = Experts(e, i, Expert)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    w = torch.rand(t, k)
    with torch.no_grad():
        got = ex(x, ids, w)
    assert len(calls) == len(set(ids.flatten().tolist())) and sum(calls) == t * k
    calls.clear()
    with torch.no_grad():
        want = torch.stack([sum(w[tok, j] * ex[int(ids[tok, j])](x[tok:tok + 1])[0]
                                for j in range(k)) for tok in range(t)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, match", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in 1..8"),
    ({"sliding_window": 64}, "sliding-window attention"),
])
def test_bad_moe_configs_refused(moe_dirs, bad, match):
    import json

    d = json.loads((moe_dirs["mixtral"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=match):
        ModelConfig.from_dict(d | bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_make_tiny_model_moe_matches_transformers(tmp_path, arch):
    """make_tiny_model's MoE checkpoints (what ``kvpool make-model --arch`` writes) load in
    transformers and give the same greedy continuation of a text prompt."""
    pytest.importorskip("transformers")
    from kvpool.engine.model.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch=arch, layers=2, hidden=64, heads=4,
                           kv_heads=2, vocab=VOCAB, num_experts=4, experts_per_token=2)
    llm = LLM(str(path), num_kv_blocks=32)
    ids = llm.tokenizer.encode("Once upon a time there was a little cat")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    with torch.no_grad():
        gen = load_hf(path).generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out.output_token_ids == gen
    assert len(set(gen)) > 6, "random model degenerate: raise initializer_range"
