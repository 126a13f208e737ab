"""The type checker gate: ``mypy`` with the ``[tool.mypy]`` config of pyproject.toml
(strict on the packages listed in its ``files``) reports no error. Runs in ``make test``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_mypy_strict_reports_no_error():
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: `pip install -e '.[test]'` (make test does)")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--no-error-summary", "--hide-error-context", "--no-color-output"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert proc.returncode == 0 and not errors, (
        f"mypy found {len(errors)} error(s):\n{proc.stdout}{proc.stderr}")
