"""Import circles inside the kvpool package: the strongly connected components of the
graph "module A imports module B" (every import statement, at module level or inside a
function, TYPE_CHECKING blocks included: a reader needs those types too).

    python scripts/import_cycles.py [--max N]

Prints each circle of more than one module, largest first, and exits 1 when one has more
than N modules (default: print only, exit 0)."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvpool"


def module_name(path: Path, root: Path = ROOT) -> str:
    """``path``'s dotted module name, ``root`` being the folder that holds the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    current = module_name(path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(current, is_package, node)
            # ``from pkg import sub`` imports the module pkg.sub; ``from mod import name``
            # imports mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        for target in targets:
            # the longest known module that prefixes the target (a name imported from a
            # module counts as an import of that module)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != current and target.startswith(PACKAGE):
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    modules = {module_name(f) for f in files}
    edges = {module_name(f): imports_of(f, modules) for f in files}
    # an import of a package is an import of its __init__ only (what Python runs)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out, key=lambda c: (-len(c), c))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=None,
                        help="exit 1 when a circle has more than this many modules")
    args = parser.parse_args()
    found = circles(graph())
    for component in found:
        print(f"{len(component)}: {' '.join(component)}")
    if not found:
        print("no import circles")
    if args.max is not None and any(len(c) > args.max for c in found):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
