"""Run a function right after a module is imported (or now, if it already is).

The plugin is loaded early in every vLLM process, before most of vLLM is imported; patching
lazily keeps the API server from importing the model runner or the scheduler it never uses.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

Patch = Callable[[ModuleType], None]
_pending: dict[str, list[Patch]] = {}
_lock = threading.Lock()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            with _lock:
                fns = _pending.pop(fullname, [])
            for fn in fns:
                fn(module)

        # this one module's loader (an importlib object) runs the patches after the module
        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


_finder = _Finder()


def when_imported(name: str, fn: Patch) -> None:
    """Call ``fn(module)`` once ``name`` is imported (at once if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None:
        fn(mod)
        return
    with _lock:
        _pending.setdefault(name, []).append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
