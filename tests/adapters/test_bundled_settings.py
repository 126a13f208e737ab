"""The bundled adapter's settings from ``KVPOOL_*`` variables (no daemon)."""

from __future__ import annotations

import pytest

from kvpool.engine_adapters.bundled import Settings


def test_from_env_reads_every_knob(monkeypatch):
    for k, v in {"KVPOOL_TENANT": "chat", "KVPOOL_RUN_DIR": "/tmp/x", "KVPOOL_DEVICE": "1",
                 "KVPOOL_MIN": "1MiB", "KVPOOL_WEIGHT": "2.5", "KVPOOL_IDLE_TIMEOUT": "3",
                 "KVPOOL_MAX": "9MiB"}.items():
        monkeypatch.setenv(k, v)
    assert Settings.from_env() == Settings(name="chat", run_dir="/tmp/x", device=1,
                                           min_bytes=1 << 20, weight=2.5, idle_timeout_s=3.0)


def test_from_env_defaults_and_bad_values(monkeypatch):
    for k in ("KVPOOL_TENANT", "KVPOOL_RUN_DIR", "KVPOOL_DEVICE", "KVPOOL_MIN",
              "KVPOOL_WEIGHT", "KVPOOL_IDLE_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    assert Settings.from_env() == Settings()
    monkeypatch.setenv("KVPOOL_DEVICE", "gpu0")
    with pytest.raises(ValueError):
        Settings.from_env()
