"""Checkpoint loading: clear CheckpointErrors for broken folders, sharded checkpoints,
both rope config forms."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpool.engine import LLM, CheckpointError, SamplingParams
from kvpool.engine.model.config import ModelConfig

from .helpers import prompts


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path))


def test_no_safetensors(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama"], tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        LLM(str(d))


def test_missing_tensor_is_named(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama"], tmp_path)
    _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError,
                       match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj"):
        LLM(str(d))


def test_unexpected_tensor_is_named(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama"], tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): model\.layers\.0\.extra"):
        LLM(str(d))


def test_shape_mismatch_is_named(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 200
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gate_proj.weight has shape"):
        LLM(str(d))


def test_unsupported_architecture(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'"):
        LLM(str(d))


def test_tied_qwen3_has_no_lm_head_in_file(hf_dirs):
    assert "lm_head.weight" not in load_file(hf_dirs["qwen3"] / "model.safetensors")


def test_sharded_checkpoint_loads(hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    d = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(hf_dirs["llama"], dtype=torch.float32).save_pretrained(
        d, max_shard_size="300KB")
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("*.safetensors"))) > 1
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ps = prompts((5, 20))
    a = LLM(str(d), num_kv_blocks=32).generate(ps, sp)
    b = LLM(str(hf_dirs["llama"]), num_kv_blocks=32).generate(ps, sp)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    next(iter(sorted(d.glob("*.safetensors")))).unlink()
    with pytest.raises(CheckpointError, match="shard"):
        LLM(str(d))


BASE = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
            num_hidden_layers=1, num_attention_heads=2)


def test_rope_config_both_forms():
    v4 = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0})
    v5 = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 500000.0,
                                                             "rope_type": "default"}})
    assert v4.rope_theta == v5.rope_theta == 500000.0
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    a = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": llama3})
    b = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 5e5, **llama3}})
    assert a.rope_scaling == b.rope_scaling and a.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(CheckpointError, match="rope_type 'yarn'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(CheckpointError, match="hidden_size"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "hidden_size"})


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig

    from kvpool.engine.model.layers import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_scaling=scaling,
                      rope_theta=10000.0, max_position_embeddings=1024)
    try:  # an internal API: its shape has changed between transformers versions
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    except (ImportError, KeyError, TypeError, AttributeError) as e:
        pytest.skip(f"transformers rope internals differ: {e!r}")
    ours = RotaryEmbedding(64, 10000.0, scaling, torch.device("cpu")).inv_freq
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
