"""The package's shape, checked: the rules of docs/ARCHITECTURE.md ("Structure rules")
that a reader relies on and that a change could silently break.

* no import circle of more than two modules (TYPE_CHECKING imports count: a reader
  needs those types too) — ``scripts/import_cycles.py`` prints them;
* no branch on a backend's name outside the backend registry (callers ask
  ``backend.caps``);
* no run-time patching of the project's own objects: no ``setattr`` and no assignment
  to another object's method, except in the vLLM adapter's patches of vLLM's classes;
* no mixins (a class cut across files).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kvpool"
#: vLLM's own classes are patched here (third-party seams, docs/VLLM-ADAPTER.md)
PATCHES_THIRD_PARTY = {PACKAGE / "engine_adapters" / "vllm" / "patches.py"}


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


def _import_cycles():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("import_cycles",
                                                  REPO / "scripts" / "import_cycles.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_of_more_than_two_modules() -> None:
    cycles = _import_cycles()
    big = [c for c in cycles.circles(cycles.graph()) if len(c) > 2]
    assert not big, "import circles:\n" + "\n".join(" ".join(c) for c in big)


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    cycles = _import_cycles()
    edges = {"kvpool.a": {"kvpool.b"}, "kvpool.b": {"kvpool.c"}, "kvpool.c": {"kvpool.a"},
             "kvpool.d": {"kvpool.a"}}
    assert cycles.circles(edges) == [["kvpool.a", "kvpool.b", "kvpool.c"]]


def test_no_branch_on_a_backend_name() -> None:
    pattern = re.compile(r"backend\.name\s*(==|!=)|\.name\s*(==|!=)\s*[\"'](host|cuda)[\"']")
    allowed = {PACKAGE / "vmm" / "registry.py"}
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p, text in _sources() if p not in allowed
             for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not found, "branch on capabilities (backend.caps), not names:\n" + "\n".join(found)


def _patches(tree: ast.AST) -> list[tuple[int, str]]:
    """``setattr(...)`` calls and assignments to ``X.name`` where X is a class or an
    object other than ``self``/``cls`` and the value is a function (a method swapped in)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr":
            out.append((node.lineno, "setattr"))
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id not in ("self", "cls") \
                        and isinstance(node.value, (ast.Lambda, ast.Name, ast.Call)) \
                        and target.attr in ("__init__", "step", "handle", "tick", "drop",
                                            "add_request", "abort", "released"):
                    out.append((node.lineno, f"{target.value.id}.{target.attr} = ..."))
    return sorted(out)


def test_no_run_time_patching_of_our_own_objects() -> None:
    found = [f"{p.relative_to(REPO)}:{line}: {what}"
             for p, text in _sources() if p not in PATCHES_THIRD_PARTY
             for line, what in _patches(ast.parse(text))]
    assert not found, "seams are interfaces, not patches:\n" + "\n".join(found)


def test_the_patch_finder_finds_planted_patches() -> None:
    planted = "setattr(engine, 'step', f)\nEngine.__init__ = wrapped\nself.step = 1\n"
    assert [what for _, what in _patches(ast.parse(planted))] == [
        "setattr", "Engine.__init__ = ..."]


def test_no_mixins() -> None:
    found = [f"{p.relative_to(REPO)}: class {node.name}"
             for p, text in _sources() for node in ast.walk(ast.parse(text))
             if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")]
    assert not found, "a class is whole in its file (compose instead):\n" + "\n".join(found)
