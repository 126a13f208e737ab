"""EngineConfig is frozen values; a value out of range is one EngineConfigError line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from kvpool.engine import EngineConfig, EngineConfigError, EngineSeams

BAD = [
    ({"block_size": 0}, "block_size must be positive"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be positive"),
    ({"max_num_seqs": -1}, "max_num_seqs must be positive"),
    ({"kv_layout": "interleaved"}, "bad kv_layout 'interleaved'"),
    ({"attention_backend": "flash"}, "bad attention_backend 'flash'"),
    ({"num_kv_blocks": 1}, "need >= 2 KV blocks"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
]


@pytest.mark.parametrize("kwargs,says", BAD)
def test_a_bad_value_is_one_line(kwargs, says):
    with pytest.raises(EngineConfigError) as e:
        EngineConfig(model="m", **kwargs)
    assert str(e.value) == says and isinstance(e.value, ValueError)


def test_checks_hold_under_python_O():
    """Validation is not ``assert``: ``python -O`` strips those."""
    code = ("from kvpool.engine.config import EngineConfig, EngineConfigError\n"
            "try:\n    EngineConfig(model='m', block_size=0)\n"
            "except EngineConfigError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out == "refused: block_size must be positive\n"


def test_frozen_values_and_variants():
    cfg = EngineConfig(model="m", kv_cache_size="2MiB")
    assert cfg.kv_cache_size == 2 << 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.prepack = False  # type: ignore[misc]
    variant = dataclasses.replace(cfg, enable_prefix_caching=False)
    assert variant.enable_prefix_caching is False and cfg.enable_prefix_caching is True
    with pytest.raises(EngineConfigError, match="block_size"):
        dataclasses.replace(cfg, block_size=0)


def test_hooks_are_seams_not_config():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not names & EngineSeams.names(), names & EngineSeams.names()
    with pytest.raises(TypeError, match="unknown engine option.*block_pool_factory"):
        EngineConfig.from_kwargs("m", block_pool_factory=None)
