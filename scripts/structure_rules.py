"""Structure rules of docs/ARCHITECTURE.md ("Structure rules") checked by meaning, not by
name, over a package's source tree:

* ``patch``: a callable (a lambda, a def, a bound method, ``functools.partial``) assigned
  onto another object's attribute (``obj.attr = f`` where ``obj`` is not the ``self`` or
  ``cls`` of the enclosing method), an assignment over a method of one of the package's
  classes, or a ``setattr`` on another object: run-time patching;
* ``cut-class``: a class that declares an attribute (an annotation in its body) that
  neither it nor a base class of the package assigns: a class cut across files (a mixin,
  whatever its name);
* ``backend-name``: a comparison (``==``, ``!=``, ``in``, ``is``, ``match``) with a
  backend's name outside ``vmm/`` and ``cli/``: callers ask ``backend.caps``;
* ``layer``: an import (at module level or in a function, ``TYPE_CHECKING`` included) of
  a sub-package that sits above the importer (:data:`ABOVE`: data flows engine ->
  adapter -> client_lib -> wire -> daemon -> vmm, servers above adapters, never back),
  or of a library its folder must not load (:data:`NO_LIBRARY`: the daemon never
  imports torch).

    python scripts/structure_rules.py [PACKAGE_DIR]

prints each finding not in :data:`ALLOWED` (and each allowance that matched nothing) and
exits 1 when there is one; another package than this checkout's has no allowances.
``tests/test_structure.py`` runs it over the package and over planted violations."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_cycles  # noqa: E402  (one reading of imports: scripts/import_cycles.py)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvpool"

#: the names a backend goes by: the keys of ``kvpool.vmm.registry.REGISTRY`` (the test
#: checks the two agree). ``auto`` is a choice the registry resolves, not a backend (and
#: ``auto`` is also a dtype, a layout, a device choice...)
BACKEND_NAMES = frozenset({"cuda", "host"})
#: where a backend's name may be compared: the registry and the CLI that parses it
BACKEND_NAME_HOMES = ("vmm/", "cli/")

_SERVERS = {"elastic_server", "fleet", "cli", "demo"}
#: sub-package -> the sub-packages it must never import (docs/ARCHITECTURE.md, "Layout")
ABOVE: dict[str, frozenset[str]] = {
    "engine": frozenset({"engine_adapters", "client_lib", "protocol", "daemon", "vmm",
                         *_SERVERS}),
    "engine_adapters": frozenset({"daemon", *_SERVERS}),
    "elastic_server": frozenset({"daemon", "fleet", "cli", "demo"}),
    "client_lib": frozenset({"engine", "engine_adapters", "daemon", *_SERVERS}),
    "protocol": frozenset({"engine", "engine_adapters", "client_lib", "daemon", "vmm",
                           *_SERVERS}),
    "daemon": frozenset({"engine", "engine_adapters", "client_lib", *_SERVERS}),
    "vmm": frozenset({"engine", "engine_adapters", "client_lib", "protocol", "daemon",
                      *_SERVERS}),
    "fleet": frozenset({"cli", "demo"}),
}
#: sub-package -> third-party libraries it must never import
NO_LIBRARY: dict[str, frozenset[str]] = {
    "daemon": frozenset({"torch", "vllm"}), "vmm": frozenset({"torch", "vllm"}),
    "protocol": frozenset({"torch", "vllm"}), "engine": frozenset({"vllm"}),
}

_VLLM = "engine_adapters/vllm/patches.py"
_VLLM_SEAM = ("vLLM offers no seam here: its own {} is wrapped when vLLM imports it "
              "(docs/VLLM-ADAPTER.md, third-party patches)")
_TORCH_DEVICE = "a torch/DLPack device type (``tensor_device``), not a backend's name"

#: findings that are kept, each with its reason: (rule, path inside the package, key).
#: Only third-party extension points (vLLM's and importlib's objects), device types and
#: what issue 35 reshapes belong here.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("patch", _VLLM, "_patch_arg_utils: cls.create_engine_config"):
        _VLLM_SEAM.format("EngineArgs.create_engine_config (the config check)"),
    ("patch", _VLLM, "_patch_cpu_worker: cls.determine_available_memory"):
        _VLLM_SEAM.format("CPUWorker.determine_available_memory (kvpool sizes the KV)"),
    ("patch", _VLLM, "_patch_gpu_worker: cls.determine_available_memory"):
        _VLLM_SEAM.format("Worker.determine_available_memory (kvpool sizes the KV)"),
    ("patch", _VLLM, "_patch_gpu_worker: setattr(mod, 'request_memory', ...)"):
        _VLLM_SEAM.format("gpu_worker.request_memory (its free-memory check)"),
    ("patch", _VLLM, "_patch_engine_core: setattr(mod, 'get_kv_cache_configs', ...)"):
        _VLLM_SEAM.format("get_kv_cache_configs (whole chunks of blocks)"),
    ("patch", _VLLM, "_patch_engine_core: setattr(cls, name, ...)"):
        _VLLM_SEAM.format("EngineCore's step and request methods (the step lock)"),
    ("patch", _VLLM,
     "_patch_engine_core: setattr(mod.EngineCore, '_initialize_kv_caches', ...)"):
        _VLLM_SEAM.format("EngineCore._initialize_kv_caches (the step lock under TP)"),
    ("patch", _VLLM, "_patch_sleep: setattr(mod.EngineCore, 'add_request', ...)"):
        _VLLM_SEAM.format("EngineCore.add_request (a request wakes a sleeping engine)"),
    ("patch", _VLLM,
     "_patch_sleep: setattr(mod.EngineCoreProc, '_process_engine_step', ...)"):
        _VLLM_SEAM.format("EngineCoreProc._process_engine_step (idle and TP polls)"),
    ("patch", _VLLM, "_patch_sleep: setattr(mod.EngineCore, 'is_sleeping', ...)"):
        _VLLM_SEAM.format("EngineCore.is_sleeping (kvpool's sleep counts)"),
    ("patch", _VLLM, "_patch_sleep: setattr(mod.EngineCore, 'wake_up', ...)"):
        _VLLM_SEAM.format("EngineCore.wake_up (it wakes a sleep of kvpool's too)"),
    ("patch", _VLLM, "_patch_sleep: setattr(mod.EngineCore, 'kvpool_sleep_state', ...)"):
        _VLLM_SEAM.format("EngineCore's utility calls (the sleep counts: a method added)"),
    ("patch", _VLLM, "_patch_sleep: setattr(mod.EngineCore, 'kvpool_wake', ...)"):
        _VLLM_SEAM.format("EngineCore's utility calls (a wake answering its failure: added)"),
    ("patch", _VLLM, "_patch_sleep_routes: setattr(mod, 'attach_router', ...)"):
        _VLLM_SEAM.format("the dev sleep router's attach_router (kvpool's routes first)"),
    ("patch", _VLLM, "_patch_api_routers: setattr(mod, 'register_api_routers', ...)"):
        _VLLM_SEAM.format("the API server's register_api_routers (POST /kvpool/weights)"),
    ("patch", _VLLM, "_patch_cpu_worker_sleep: setattr(cls, name, ...)"):
        _VLLM_SEAM.format("CPUWorker.sleep/wake_up (no-ops on CPU: the KV-level sleep)"),
    ("patch", _VLLM, "_patch_allocate: setattr(mod, 'allocate_kv_cache', ...)"):
        _VLLM_SEAM.format("allocate_kv_cache (the KV cache in kvpool memory)"),
    ("patch", _VLLM, "_patch_coordinator: setattr(mod, 'BlockPool', ...)"):
        _VLLM_SEAM.format("BlockPool class (the elastic block pool)"),
    ("patch", _VLLM, "_patch_manager: cls.allocate_slots"):
        _VLLM_SEAM.format("KVCacheManager.allocate_slots (blocks asked for on demand)"),
    ("patch", _VLLM, "_patch_scheduler: cls.__init__"):
        _VLLM_SEAM.format("Scheduler.__init__ (the pool's shrink callback and idle release)"),
    ("patch", _VLLM, "_patch_metrics: setattr(mod, 'get_prometheus_registry', ...)"):
        _VLLM_SEAM.format("the metrics router's get_prometheus_registry (kvpool's gauges "
                          "on the registry vLLM's /metrics serves)"),
    ("patch", _VLLM, "_patch_executor: cls.initialize_from_config"):
        _VLLM_SEAM.format("Executor.initialize_from_config (the TP allocator)"),
    ("patch", "engine_adapters/vllm/block_pool.py",
     "allocate_slots.allocate_slots: coord.get_num_blocks_to_allocate"):
        _VLLM_SEAM.format("KV cache coordinator's get_num_blocks_to_allocate (the blocks "
                          "one allocation needs; an instance attribute for one call)"),
    ("patch", "engine_adapters/vllm/hooks.py", "_Finder.find_spec: loader.exec_module"):
        "importlib's loader of one vLLM module runs the patches once the module is "
        "executed: importlib has no post-import hook",
    ("backend-name", "client_lib/tensors.py", "backend.caps.tensor_device == 'cuda'"):
        _TORCH_DEVICE,
    ("backend-name", "engine/engine.py", "self.device.type == 'cuda'"): _TORCH_DEVICE,
}

#: bases and decorators whose annotations are fields the class's machinery assigns
_FIELD_BASES = frozenset({"NamedTuple", "TypedDict", "Struct", "Enum", "IntEnum", "StrEnum",
                          "Flag", "IntFlag", "BaseModel"})
#: interfaces: what they declare, their implementations assign
_INTERFACE_BASES = frozenset({"Protocol", "ABC"})
_PARTIALS = frozenset({"partial", "partialmethod", "MethodType"})


@dataclass(frozen=True)
class Finding:
    rule: str
    path: str  # inside the package, posix
    line: int
    key: str  # what ALLOWED names: the target, ``Class.attr``, or the comparison

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.key}"


@dataclass
class _Class:
    name: str
    module: str
    bases: list[str]
    methods: set[str] = field(default_factory=set)  # defs that are not properties
    properties: set[str] = field(default_factory=set)
    declared: dict[str, int] = field(default_factory=dict)  # annotation only -> line
    assigned: set[str] = field(default_factory=set)
    #: "fields": its annotations are fields its machinery assigns (a dataclass, a
    #: NamedTuple...); "interface": what it declares, implementations assign (a Protocol,
    #: an abstract class); "plain": it assigns what it declares
    kind: Literal["plain", "fields", "interface"] = "plain"
    #: a base's machinery makes every subclass's annotations fields too (msgspec's
    #: Struct, pydantic's BaseModel...; not a dataclass)
    fields_base: bool = False


@dataclass
class _Module:
    name: str
    path: str
    tree: ast.Module
    defs: set[str] = field(default_factory=set)  # module-level functions
    classes: dict[str, _Class] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local -> (mod, name)


def _name_of(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _name_of(node.value)
    if isinstance(node, ast.Call):
        return _name_of(node.func)
    return ""


def _is_property(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(_name_of(d) in ("property", "cached_property", "setter", "getter", "deleter")
               for d in fn.decorator_list)


def _self_name(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    if any(_name_of(d) == "staticmethod" for d in fn.decorator_list):
        return None
    args = fn.args.posonlyargs + fn.args.args
    return args[0].arg if args else None


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """Every expression a statement assigns to (tuples unpacked)."""
    raw: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        raw = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        raw = [node.target]
    while raw:
        t = raw.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            raw.extend(t.elts)
        elif isinstance(t, ast.Starred):
            raw.append(t.value)
        else:
            yield t


def _module_name(root: Path, path: Path) -> str:
    return import_cycles.module_name(path, root.parent)


def _index(package_dir: Path) -> dict[str, _Module]:
    modules: dict[str, _Module] = {}
    for path in sorted(package_dir.rglob("*.py")):
        name = _module_name(package_dir, path)
        tree = ast.parse(path.read_text(), str(path))
        mod = _Module(name, path.relative_to(package_dir).as_posix(), tree)
        mod.defs.update(n.name for n in tree.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = import_cycles.resolve(name, path.name == "__init__.py", node)
                for alias in node.names:
                    mod.imports[alias.asname or alias.name] = (base, alias.name)
            elif isinstance(node, ast.ClassDef):
                mod.classes[node.name] = _class_info(node, name)
        modules[name] = mod
    return modules


def _class_info(node: ast.ClassDef, module: str) -> _Class:
    info = _Class(node.name, module, [_name_of(b) for b in node.bases])
    if any(b in _FIELD_BASES for b in info.bases):
        info.kind, info.fields_base = "fields", True
    elif any(_name_of(d).endswith("dataclass") for d in node.decorator_list):
        info.kind = "fields"
    elif any(b in _INTERFACE_BASES for b in info.bases) \
            or any(_name_of(k.value) == "ABCMeta" for k in node.keywords) \
            or any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and any(_name_of(d) == "abstractmethod" for d in f.decorator_list)
                   for f in node.body):
        info.kind = "interface"
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if stmt.value is None and _name_of(stmt.annotation) != "ClassVar":
                info.declared[stmt.target.id] = stmt.lineno
            else:
                info.assigned.add(stmt.target.id)
        elif isinstance(stmt, (ast.Assign, ast.AugAssign)):
            info.assigned.update(t.id for t in _targets(stmt) if isinstance(t, ast.Name))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            (info.properties if _is_property(stmt) else info.methods).add(stmt.name)
            me = _self_name(stmt)
            if me is None:
                continue
            for sub in ast.walk(stmt):
                for t in _targets(sub):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                            and t.value.id == me:
                        info.assigned.add(t.attr)
    return info


class _Package:
    def __init__(self, package_dir: Path) -> None:
        self.modules = _index(package_dir)
        #: every method name of the package's classes that no class uses as data
        data: set[str] = set()
        methods: set[str] = set()
        for mod in self.modules.values():
            for cls in mod.classes.values():
                methods |= cls.methods
                data |= cls.assigned | set(cls.declared) | cls.properties
        self.method_names = methods - data

    def lookup_class(self, mod: _Module, name: str) -> _Class | None:
        if name in mod.classes:
            return mod.classes[name]
        if name in mod.imports:
            source, original = mod.imports[name]
            target = self.modules.get(source)
            if target is not None and original in target.classes:
                return target.classes[original]
        return None

    def is_def(self, mod: _Module, name: str) -> bool:
        if name in mod.defs:
            return True
        if name in mod.imports:
            source, original = mod.imports[name]
            target = self.modules.get(source)
            return target is not None and original in target.defs
        return False

    def fields_base(self, mod: _Module, cls: _Class, depth: int = 0) -> bool:
        """Whether ``cls`` derives from a base whose subclasses' annotations are fields."""
        if cls.fields_base or depth > 20:
            return cls.fields_base
        for base in cls.bases:
            found = self.lookup_class(mod, base)
            if found is not None and self.fields_base(self.modules[found.module], found,
                                                      depth + 1):
                return True
        return False

    def assigned_by(self, mod: _Module, cls: _Class, seen: frozenset[str] = frozenset()
                    ) -> set[str]:
        """Attributes ``cls`` or a base of the package assigns (a dataclass's fields
        included)."""
        out = cls.assigned | (set(cls.declared) if cls.kind == "fields" else set())
        for base in cls.bases:
            found = self.lookup_class(mod, base)
            key = f"{found.module}.{found.name}" if found else ""
            if found is None or key in seen:
                continue
            out |= self.assigned_by(self.modules[found.module], found, seen | {key})
        return out


def _patches(pkg: _Package, mod: _Module) -> Iterator[Finding]:
    """Keys: ``where: target`` (``where`` the enclosing function's qualified name)."""

    def callable_value(value: ast.expr, local_defs: set[str], cls: _Class | None,
                       me: str | None, local_types: dict[str, _Class]) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in local_defs or pkg.is_def(mod, value.id)
        if isinstance(value, ast.Call):
            return _name_of(value.func) in _PARTIALS
        if isinstance(value, ast.Attribute):
            # a bound method: of the enclosing class through self, of a package class, or
            # any name that is only ever a method in the package
            if me is not None and isinstance(value.value, ast.Name) \
                    and value.value.id == me and cls is not None:
                return value.attr in cls.methods
            found = None
            if isinstance(value.value, ast.Name):
                found = local_types.get(value.value.id) or pkg.lookup_class(mod,
                                                                            value.value.id)
            return (found is not None and value.attr in found.methods) \
                or value.attr in pkg.method_names
        return False

    def instances(fn: ast.AST) -> dict[str, _Class]:
        """Local names bound to a package class's instance (``x = Class(...)``)."""
        out: dict[str, _Class] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) \
                    and isinstance(n.value.func, ast.Name):
                found = pkg.lookup_class(mod, n.value.func.id)
                if found is not None:
                    out.update((t.id, found) for t in _targets(n) if isinstance(t, ast.Name))
        return out

    def visit(node: ast.AST, where: str, cls: _Class | None, me: str | None,
              local_defs: set[str], local_types: dict[str, _Class]
              ) -> Iterator[Finding]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{where}{child.name}.", mod.classes.get(child.name),
                                 None, local_defs, local_types)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = {n.name for n in ast.walk(child)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                method = isinstance(node, ast.ClassDef)
                yield from visit(child, f"{where}{child.name}.", cls,
                                 _self_name(child) if method else me, local_defs | inner,
                                 local_types | instances(child))
                continue
            at = where.rstrip(".") or "<module>"
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) \
                    and child.func.id == "setattr" and len(child.args) >= 2 \
                    and not (isinstance(child.args[0], ast.Name) and child.args[0].id == me):
                yield Finding("patch", mod.path, child.lineno,
                              f"{at}: setattr({ast.unparse(child.args[0])}, "
                              f"{ast.unparse(child.args[1])}, ...)")
            value = getattr(child, "value", None)
            for t in _targets(child):
                if not isinstance(t, ast.Attribute):
                    continue
                if isinstance(t.value, ast.Name) and t.value.id == me:
                    continue
                if t.attr in pkg.method_names or (
                        isinstance(value, ast.expr) and callable_value(value, local_defs, cls,
                                                                       me, local_types)):
                    yield Finding("patch", mod.path, t.lineno, f"{at}: {ast.unparse(t)}")
            yield from visit(child, where, cls, me, local_defs, local_types)

    yield from visit(mod.tree, "", None, None, set(), instances(mod.tree))


def _cut_classes(pkg: _Package, mod: _Module) -> Iterator[Finding]:
    for cls in mod.classes.values():
        if not cls.declared or cls.kind != "plain" or pkg.fields_base(mod, cls):
            continue
        assigned = pkg.assigned_by(mod, cls)
        for attr, line in sorted(cls.declared.items(), key=lambda kv: kv[1]):
            if attr not in assigned:
                yield Finding("cut-class", mod.path, line, f"{cls.name}.{attr}")


def _backend_names(mod: _Module) -> Iterator[Finding]:
    if mod.path.startswith(BACKEND_NAME_HOMES):
        return

    def names_in(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in BACKEND_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_in(e) for e in node.elts)
        return False

    def pattern_names(p: ast.pattern) -> bool:
        if isinstance(p, ast.MatchValue):
            return names_in(p.value)
        if isinstance(p, ast.MatchOr):
            return any(pattern_names(q) for q in p.patterns)
        if isinstance(p, ast.MatchAs) and p.pattern is not None:
            return pattern_names(p.pattern)
        return False

    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Compare) and any(
                names_in(e) for e in [node.left, *node.comparators]):
            yield Finding("backend-name", mod.path, node.lineno, ast.unparse(node))
        elif isinstance(node, ast.match_case) and pattern_names(node.pattern):
            yield Finding("backend-name", mod.path, node.pattern.lineno,
                          f"case {ast.unparse(node.pattern)}")


def _layers(mod: _Module, package: str) -> Iterator[Finding]:
    home = mod.path.split("/")[0] if "/" in mod.path else ""
    above, libraries = ABOVE.get(home, frozenset()), NO_LIBRARY.get(home, frozenset())
    if not above and not libraries:
        return
    is_package = mod.path.endswith("__init__.py")
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = [import_cycles.resolve(mod.name, is_package, node)]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == package and len(parts) > 1 and parts[1] in above:
                yield Finding("layer", mod.path, node.lineno, f"{home} imports {parts[1]}")
            elif parts[0] in libraries:
                yield Finding("layer", mod.path, node.lineno, f"{home} imports {parts[0]}")


def findings(package_dir: Path) -> list[Finding]:
    """Every finding in the package at ``package_dir``, allowed ones included."""
    pkg = _Package(package_dir)
    out: list[Finding] = []
    for mod in pkg.modules.values():
        out += _patches(pkg, mod)
        out += _cut_classes(pkg, mod)
        out += _backend_names(mod)
        out += _layers(mod, package_dir.name)
    return sorted(set(out), key=lambda f: (f.path, f.line, f.rule, f.key))


def check(package_dir: Path, allowed: dict[tuple[str, str, str], str] | None = None
          ) -> tuple[list[Finding], list[tuple[str, str, str]]]:
    """The findings not allowed, and the allowances that matched nothing (stale)."""
    allowed = ALLOWED if allowed is None else allowed
    found = findings(package_dir)
    keys = {(f.rule, f.path, f.key) for f in found}
    return ([f for f in found if (f.rule, f.path, f.key) not in allowed],
            [k for k in allowed if k not in keys])


def main() -> int:
    package_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / PACKAGE
    ours = package_dir.resolve() == (ROOT / PACKAGE).resolve()
    bad, stale = check(package_dir, None if ours else {})
    for f in bad:
        print(f)
    for k in stale:
        print(f"stale allowance (matches nothing): {k}")
    if not bad and not stale:
        print("no findings")
    return 1 if bad or stale else 0


if __name__ == "__main__":
    sys.exit(main())
