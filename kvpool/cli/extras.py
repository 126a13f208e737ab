"""Commands that need an optional extra say so in one line instead of a traceback.

The core install (``pip install kvpool``) runs the daemon, the CLI and the client
library without torch; ``kvpool serve``/``generate``/``make-model`` need
``kvpool[engine]`` and ``kvpool demo`` needs ``kvpool[demo]``. Each such command calls
:func:`require` before importing anything of the extra.
"""

from __future__ import annotations

import importlib.util

import click

#: the modules each extra provides that its commands import (pyproject.toml's extras)
EXTRAS: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "safetensors", "tokenizers", "fastapi", "uvicorn", "httpx"),
    "demo": ("torch", "safetensors", "tokenizers", "fastapi", "uvicorn", "httpx",
             "matplotlib"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this interpreter cannot import."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, command: str) -> None:
    """Stop ``kvpool <command>`` with one line (exit 1) unless ``extra`` is installed."""
    gone = missing(extra)
    if gone:
        raise click.ClickException(
            f"`kvpool {command}` needs the {extra} extra (missing: {', '.join(gone)}): "
            f"pip install 'kvpool[{extra}]'")
