"""Post-import hooks: run a callback on a module right after it is first imported.

A tiny ``sys.meta_path`` finder: for a watched module name it asks the other finders for the spec
and wraps the spec's loader, so that the callback runs once ``exec_module`` has finished. If the
module is already imported when the hook is registered, the callback runs at once. Nothing heavy
is imported here (the verl plugin loads this inside inference servers too).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list[Callback]] = {}


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks registered for the module."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            callbacks = _hooks.pop(self._name, [])
        for callback in callbacks:
            callback(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of watched modules found by the other finders."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in _hooks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def when_imported(name: str, callback: Callback) -> None:
    """Run ``callback(module)`` once module ``name`` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    callback(module)


def pending(name: str) -> bool:
    """Whether a hook for ``name`` is registered and has not fired yet."""
    with _lock:
        return bool(_hooks.get(name))
