"""A real daemon (from the daemon tests' fixtures), a tiny model, and ``kvpool serve``
servers on it (``servers``; test_vllm.py has its own, for vLLM) for adapter tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from daemon.conftest import start_daemon  # noqa: F401  (re-exported fixture)

from .serve_procs import Servers


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.engine.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=2,
                           hidden=128, heads=4, kv_heads=2, vocab=512, seed=0)


@pytest.fixture
def servers(tiny_model: Path, tmp_path: Path) -> Iterator[Servers]:
    """Servers of the tiny model, logs in the test's tmp dir; every one killed after."""
    s = Servers(tiny_model, tmp_path)
    yield s
    s.close()
