"""The bundled adapter's settings from ``KVPOOL_*`` variables (no daemon); the old
``KVPOOL_WEIGHT`` (now ``KVPOOL_SHARES``) in both adapters' settings."""

from __future__ import annotations

import pytest

import kvpool.renames
from kvpool.engine_adapters.bundled import Settings
from kvpool.engine_adapters.env import SettingsError
from kvpool.engine_adapters.vllm.settings import Settings as VllmSettings

OLD_LINE = "kvpool: KVPOOL_WEIGHT is deprecated, use KVPOOL_SHARES (removed in the next release)"


def test_from_env_reads_every_knob(monkeypatch):
    for k, v in {"KVPOOL_TENANT": "chat", "KVPOOL_RUN_DIR": "/tmp/x", "KVPOOL_DEVICE": "1",
                 "KVPOOL_MIN": "1MiB", "KVPOOL_SHARES": "2.5", "KVPOOL_IDLE_TIMEOUT": "3",
                 "KVPOOL_MAX": "9MiB"}.items():
        monkeypatch.setenv(k, v)
    assert Settings.from_env() == Settings(name="chat", run_dir="/tmp/x", device=1,
                                           min_bytes=1 << 20, max_bytes=9 << 20, shares=2.5,
                                           idle_timeout_s=3.0)


def test_from_env_defaults_and_bad_values(monkeypatch):
    for k in ("KVPOOL_TENANT", "KVPOOL_RUN_DIR", "KVPOOL_DEVICE", "KVPOOL_MIN",
              "KVPOOL_SHARES", "KVPOOL_WEIGHT", "KVPOOL_IDLE_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    assert Settings.from_env() == Settings()
    monkeypatch.setenv("KVPOOL_DEVICE", "gpu0")
    with pytest.raises(ValueError):
        Settings.from_env()


@pytest.mark.parametrize("var,value,want", [
    ("KVPOOL_SLEEPABLE", "1", ("sleepable", True)),
    ("KVPOOL_SLEEPABLE", "off", ("sleepable", False)),
    ("KVPOOL_SLEEP_AFTER", "2.5", ("sleep_after_s", 2.5)),
    ("KVPOOL_SLEEP_AFTER", "0", ("sleep_after_s", None)),
])
def test_sleep_settings(monkeypatch, var, value, want):
    monkeypatch.setenv(var, value)
    assert getattr(Settings.from_env(), want[0]) == want[1]


@pytest.mark.parametrize("var,value", [
    ("KVPOOL_SLEEPABLE", "maybe"), ("KVPOOL_SLEEP_AFTER", "soon"),
    ("KVPOOL_SLEEP_AFTER", "-3"), ("KVPOOL_SLEEP_AFTER", "inf"), ("KVPOOL_SLEEP_AFTER", "nan"),
])
def test_bad_sleep_settings_are_one_line_naming_the_variable(monkeypatch, tiny_model, var,
                                                             value):
    from kvpool.engine.config import EngineConfig
    from kvpool.engine_adapters.bundled import AdapterError, enable
    from kvpool.engine_adapters.env import SettingsError

    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as e:
        Settings.from_env()
    msg = str(e.value)
    assert msg.startswith(f"{var}=") and "\n" not in msg, msg
    with pytest.raises(AdapterError, match=f"^{var}="):  # what `kvpool serve` prints
        enable(EngineConfig(model=str(tiny_model)))


def test_enable_returns_one_adapter_and_leaves_the_config_alone(tiny_model):
    """The adapter object is passed in (the engine's seams), not stored in the config;
    a request-aligned engine, or one whose KV layout is ``auto`` (block-major under
    kvpool: a small allocation unit), runs a variant of the config, the caller's is
    unchanged."""
    import dataclasses

    from kvpool.engine import EngineConfig
    from kvpool.engine_adapters.bundled import ELASTIC_LAYOUT, BundledBridge, enable

    cfg = EngineConfig(model=str(tiny_model), kv_layout="per_layer")
    before = dataclasses.asdict(cfg)
    pooled = enable(cfg, Settings(name="a"))
    aligned = enable(cfg, Settings(name="b", request_aligned=True, weights="local"))
    assert dataclasses.asdict(cfg) == before
    assert isinstance(pooled, BundledBridge) and pooled.seams.adapter is pooled
    assert pooled.config is cfg and pooled.seams.model_factory == pooled.make_model
    assert aligned.seams.adapter is aligned and aligned.seams.model_factory is None
    assert aligned.config.enable_prefix_caching is False
    assert aligned.config == dataclasses.replace(cfg, enable_prefix_caching=False)
    auto = EngineConfig(model=str(tiny_model))
    assert auto.kv_layout == "auto" and ELASTIC_LAYOUT == "block_major"
    assert enable(auto, Settings(name="c")).config == dataclasses.replace(
        auto, kv_layout="block_major")
    assert auto.kv_layout == "auto"


@pytest.mark.parametrize("settings", [Settings, VllmSettings])
def test_the_old_kvpool_weight_still_works_with_one_line(monkeypatch, capsys, settings):
    monkeypatch.setattr(kvpool.renames, "_said", set())  # (said once per process)
    monkeypatch.delenv("KVPOOL_SHARES", raising=False)
    monkeypatch.setenv("KVPOOL_WEIGHT", "2.5")
    assert settings.from_env().shares == 2.5
    assert settings.from_env().shares == 2.5  # (read again: not said again)
    assert capsys.readouterr().err.splitlines() == [OLD_LINE]
    monkeypatch.delenv("KVPOOL_WEIGHT")
    monkeypatch.setenv("KVPOOL_SHARES", "3")
    assert settings.from_env().shares == 3.0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("settings", [Settings, VllmSettings])
def test_kvpool_shares_and_weight_together_are_refused(monkeypatch, settings):
    monkeypatch.setenv("KVPOOL_SHARES", "2")
    monkeypatch.setenv("KVPOOL_WEIGHT", "3")
    with pytest.raises(SettingsError) as e:
        settings.from_env()
    assert str(e.value) == ("KVPOOL_SHARES and KVPOOL_WEIGHT are both given: KVPOOL_WEIGHT "
                            "is the old name of KVPOOL_SHARES; give KVPOOL_SHARES only")
