"""The package's shape, checked: the rules of docs/ARCHITECTURE.md ("Structure rules")
that a reader relies on and that a change could silently break.

* no import circle (TYPE_CHECKING imports count: a reader needs those types too) —
  ``scripts/import_cycles.py`` prints them;
* checked by meaning, not by name (``scripts/structure_rules.py``): no callable assigned
  onto another object's attribute (run-time patching), no class declaring attributes it
  never assigns (a class cut across files), no comparison with a backend's name outside
  ``vmm/`` and ``cli/``, no import of a layer above the importer (data flows engine ->
  adapter -> client_lib -> wire -> daemon -> vmm; the daemon never imports torch); what
  is allowed is listed there, each with its reason;
* docs/ARCHITECTURE.md's layout is the tree's (``scripts/layout_tree.py``).

Each checker is also run over planted violations, so a checker that stops finding
anything fails here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kvpool"


def _script(name: str):  # type: ignore[no-untyped-def]
    """scripts/NAME.py as a module (registered: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _import_cycles():  # type: ignore[no-untyped-def]
    return _script("import_cycles")


def test_no_import_circle() -> None:
    cycles = _import_cycles()
    found = cycles.circles(cycles.graph())
    assert not found, "import circles:\n" + "\n".join(" ".join(c) for c in found)


def test_the_import_cycles_script_reports_none() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "import_cycles.py"),
                           "--max", "1"], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "no import circles\n"), proc.stdout


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    cycles = _import_cycles()
    edges = {"kvpool.a": {"kvpool.b"}, "kvpool.b": {"kvpool.c"}, "kvpool.c": {"kvpool.a"},
             "kvpool.d": {"kvpool.a"}}
    assert cycles.circles(edges) == [["kvpool.a", "kvpool.b", "kvpool.c"]]


def _rules():  # type: ignore[no-untyped-def]
    return _script("structure_rules")


def test_structure_rules_hold() -> None:
    """No patch of our own objects, no cut class, no backend-name branch; every
    allowance still matches something (a stale one is deleted, not kept)."""
    bad, stale = _rules().check(PACKAGE)
    assert not bad and not stale, (
        "seams are interfaces, classes are whole, callers ask backend.caps "
        "(scripts/structure_rules.py):\n" + "\n".join(map(str, bad))
        + "".join(f"\nstale allowance: {k}" for k in stale))


def test_every_allowance_has_a_reason() -> None:
    assert all(isinstance(r, str) and len(r) > 20 for r in _rules().ALLOWED.values())


def test_backend_names_are_the_registry_s() -> None:
    from kvpool.vmm.registry import REGISTRY

    assert _rules().BACKEND_NAMES == set(REGISTRY)


#: a package with one violation of each kind per way of writing it, beside code that
#: keeps the rules (the same shapes); path -> source
PLANTED = {
    "__init__.py": "",
    "pool.py": """
class Pool:
    def __init__(self) -> None:
        self.size = 0
        self.on_change = None

    def shrink(self, n: int) -> int:
        return n

    @property
    def label(self) -> str:
        return "p"
""",
    "helpers.py": """
def helper(n: int) -> int:
    return n
""",
    "patching.py": """
import functools
from planted.helpers import helper
from planted.pool import Pool


def faster(self, n):
    return 0


def install(pool: Pool, other: Pool) -> None:
    pool.shrink = lambda n: 0
    Pool.shrink = faster
    other.hook = helper
    other.wrapped = functools.partial(helper, 1)
    setattr(pool, "size", 3)
    pool.size = 3
    pool.label = "x"
    other.on_change = None

    def inner() -> None: ...

    other.callback = inner
    made = Pool()
    other.on_change = made.shrink


class Owner:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.pool.on_change = self.changed
        self.handler = self.changed
        setattr(self, "size", 1)

    def changed(self) -> None: ...
""",
    "cut.py": """
import abc
from dataclasses import dataclass
from msgspec import Struct


class CacheOps:
    blocks: list[int]
    lock: object

    def evict(self) -> int:
        return len(self.blocks)


class Engine(CacheOps):
    def __init__(self) -> None:
        self.blocks = []
        self.lock = object()


class Narrowed(Engine):
    blocks: list[int]


class Whole:
    count: int
    limit: int = 3

    def __init__(self) -> None:
        self.count = 0


@dataclass
class Values:
    a: int


class Message(Struct):
    x: int


class Reply(Message):
    y: int


class Shape(abc.ABC):
    name: str

    @abc.abstractmethod
    def area(self) -> float: ...
""",
    "backends.py": """
def open_it(backend: str, kind: str, layout: str) -> None:
    if backend == "host":
        pass
    if "cuda" != kind:
        pass
    if kind in ("cuda", "other"):
        pass
    match backend:
        case "host" | "x":
            pass
        case _:
            pass
    if kind == "auto" or layout == "per_layer":
        pass
""",
    "vmm/__init__.py": "",
    "vmm/registry.py": """
def entry(kind: str) -> int:
    return 1 if kind == "host" else 2
""",
    "engine/__init__.py": "",
    "engine/run.py": """
from planted.daemon import core
from planted.engine import __init__ as fine


def late() -> None:
    import planted.cli.main
    from ..client_lib import maps
""",
    "engine_adapters/__init__.py": "",
    "engine_adapters/bridge.py": """
from planted.engine import run
from planted.client_lib import maps
""",
    "client_lib/__init__.py": "",
    "client_lib/maps.py": """
import torch
""",
    "daemon/__init__.py": "",
    "daemon/core.py": """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import torch.nn
from planted.vmm import registry
""",
    "cli/__init__.py": "",
    "cli/main.py": """
def main(backend: str) -> bool:
    return backend == "cuda"
""",
}

PLANTED_FINDINGS = {
    ("patch", "patching.py", "install: pool.shrink"),
    ("patch", "patching.py", "install: Pool.shrink"),
    ("patch", "patching.py", "install: other.hook"),
    ("patch", "patching.py", "install: other.wrapped"),
    ("patch", "patching.py", "install: setattr(pool, 'size', ...)"),
    ("patch", "patching.py", "install: other.callback"),
    ("patch", "patching.py", "install: other.on_change"),
    ("patch", "patching.py", "Owner.__init__: self.pool.on_change"),
    ("cut-class", "cut.py", "CacheOps.blocks"),
    ("cut-class", "cut.py", "CacheOps.lock"),
    ("backend-name", "backends.py", "backend == 'host'"),
    ("backend-name", "backends.py", "'cuda' != kind"),
    ("backend-name", "backends.py", "kind in ('cuda', 'other')"),
    ("backend-name", "backends.py", "case 'host' | 'x'"),
    ("layer", "engine/run.py", "engine imports daemon"),
    ("layer", "engine/run.py", "engine imports cli"),
    ("layer", "engine/run.py", "engine imports client_lib"),
    ("layer", "daemon/core.py", "daemon imports torch"),
}


def _plant(root: Path) -> Path:
    package = root / "planted"
    for name, text in PLANTED.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_rules_find_planted_violations(tmp_path: Path) -> None:
    rules = _rules()
    found = {(f.rule, f.path, f.key) for f in rules.findings(_plant(tmp_path))}
    assert found == PLANTED_FINDINGS


def test_an_allowance_hides_its_finding_and_a_stale_one_is_reported(tmp_path: Path) -> None:
    rules = _rules()
    kept = ("patch", "patching.py", "install: Pool.shrink")
    gone = ("patch", "patching.py", "install: Pool.grow")
    bad, stale = rules.check(_plant(tmp_path), {kept: "a reason", gone: "a reason"})
    assert {(f.rule, f.path, f.key) for f in bad} == PLANTED_FINDINGS - {kept}
    assert stale == [gone]


def test_the_rules_script_fails_on_planted_violations(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "structure_rules.py"),
                           str(_plant(tmp_path))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "[patch] install: pool.shrink" in proc.stdout
    assert "stale allowance" not in proc.stdout  # the allowances are the package's


def _layout():  # type: ignore[no-untyped-def]
    return _script("layout_tree")


def test_the_architecture_layout_is_the_tree() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "layout_tree.py"),
                           "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_the_layout_shows_a_moved_module(tmp_path: Path) -> None:
    layout = _layout()
    package = tmp_path / "pkg"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text('"""A package."""')
    (package / "engine" / "__init__.py").write_text('"""The engine. More."""')
    (package / "engine" / "tp_rank.py").write_text('"""One rank; its loop."""')
    before = layout.tree(package)
    assert any("engine/" in line and "The engine" in line for line in before)
    assert any("tp_rank.py" in line and "One rank" in line for line in before)
    (package / "engine" / "tp").mkdir()
    (package / "engine" / "tp" / "__init__.py").write_text("")
    (package / "engine" / "tp_rank.py").rename(package / "engine" / "tp" / "rank.py")
    after = layout.tree(package)
    assert after != before and not any("tp_rank.py" in line for line in after)
    assert any(line.strip().startswith("rank.py") for line in after)
