"""A real daemon (from the daemon tests' fixtures) and a tiny model for adapter tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.conftest import start_daemon  # noqa: F401  (re-exported fixture)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.engine.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=2,
                           hidden=128, heads=4, kv_heads=2, vocab=512, seed=0)
