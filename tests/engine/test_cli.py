"""CLI: make-model writes a loadable checkpoint; --elastic needs the adapter."""

from __future__ import annotations

import sys

import click
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from kvpool.cli.main import cli
from kvpool.engine import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_make_model(tmp_path, arch):
    d = tmp_path / arch
    r = CliRunner().invoke(cli, ["make-model", str(d), "--layers", "1", "--hidden", "64",
                                 "--heads", "2", "--kv-heads", "1", "--arch", arch,
                                 "--seed", "3"])
    assert r.exit_code == 0, r.output
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (d / f).is_file()
    with safe_open(d / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (arch == "llama")
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) == (arch == "qwen3")
    out = LLM(str(d), num_kv_blocks=16).generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 5 and isinstance(out.text, str)


def test_generate_command(tiny_dir):
    r = CliRunner().invoke(cli, ["generate", str(tiny_dir), "Hello", "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "'Hello' ->" in r.output


def test_elastic_with_an_unknown_layout_is_a_clear_error(tiny_dir):
    from kvpool.cli import engine_cmds
    from kvpool.engine import EngineConfig

    cfg = EngineConfig(model=str(tiny_dir))
    object.__setattr__(cfg, "kv_layout", "interleaved")  # past the config's own check
    with pytest.raises(click.ClickException, match="cannot make the KV cache elastic.*layout"):
        engine_cmds._enable_elastic(cfg)


def test_serve_rejects_bad_options(tiny_dir):
    r = CliRunner().invoke(cli, ["serve", str(tiny_dir), "--kv-cache-size", "lots"])
    assert r.exit_code != 0 and "cannot parse size" in r.output


def test_import_boundaries():
    """The engine never pulls in the daemon side; the CLI module does not import torch."""
    import subprocess

    code = ("import sys, kvpool.engine, kvpool.engine.serving.server; "
            "bad = [m for m in sys.modules if m.startswith(('kvpool.daemon', "
            "'kvpool.client_lib', 'kvpool.vmm'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    code = "import sys, kvpool.cli.engine_cmds; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
