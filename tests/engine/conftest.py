"""Fixtures for the engine tests: tiny checkpoints (session-scoped) and an autouse check
that every Engine created in a test ends with consistent block bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.engine import Engine

from .helpers import VOCAB, save_hf


@pytest.fixture(autouse=True)
def _engine_integrity(monkeypatch: pytest.MonkeyPatch):
    """After each test: pool integrity, ref counts equal holders, and no leaked blocks
    once an engine has no unfinished requests."""
    created: list[Engine] = []
    orig = Engine.__init__

    def init(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        orig(self, *a, **kw)
        created.append(self)

    monkeypatch.setattr(Engine, "__init__", init)
    yield created
    for e in created:
        e.check_integrity()
        if not e.has_unfinished():
            assert e.pool.num_used_blocks == 0, "blocks still referenced after all finished"
            assert all(e.pool.ref_count(b) == 0 for b in range(1, e.pool.capacity))


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    return {a: save_hf(a, root / a) for a in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a trained tokenizer, written by our own make_tiny_model."""
    from kvpool.engine.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=2,
                           hidden=128, heads=4, kv_heads=2, vocab=VOCAB, seed=0)
