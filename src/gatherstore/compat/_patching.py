"""Swap a library's object functions for gatherstore's, in place, and undo it.

Written once for every compat module: the replacement lands on the defining
module and on every already-imported module of the same package that bound
the original by name (``from mmengine.dist import collect_results``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType, TracebackType
from typing import Any

__all__ = ["Patch", "patch_module"]

_active: dict[str, Patch] = {}


class Patch:
    """The bindings one ``patch()`` replaced; ``undo()`` (or leaving a ``with``) restores them."""

    def __init__(self, module: str, swapped: list[tuple[ModuleType, str, Any]]) -> None:
        self.module = module
        self.swapped = swapped

    @property
    def active(self) -> bool:
        """Whether the replacements are still in place."""
        return _active.get(self.module) is self

    def undo(self) -> None:
        """Put every original binding back; calling it again does nothing."""
        if not self.active:
            return
        for owner, name, original in reversed(self.swapped):
            setattr(owner, name, original)
        del _active[self.module]

    def __enter__(self) -> Patch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<gatherstore patch of {self.module}: {len(self.swapped)} bindings, {state}>"


def _import(module: str, pip_name: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"patch() needs {module}, which is not installed: pip install {pip_name}"
        ) from exc


def patch_module(
    module: str, pip_name: str, replacements: Mapping[str, Callable[..., Any]]
) -> Patch:
    """Replace ``module``'s functions named in ``replacements``, everywhere they are bound.

    Every module under the same top-level package that holds the very same
    function object gets the replacement too.  Patching an already patched
    module returns the active handle unchanged.

    Raises:
        ImportError: the library is not installed (names the pip package).
        AttributeError: ``module`` lacks a name to replace (an unsupported version).
    """
    if module in _active:
        return _active[module]
    target = _import(module, pip_name)
    originals = {name: getattr(target, name) for name in replacements}
    by_id = {id(fn): name for name, fn in originals.items()}
    package = module.split(".")[0]
    swapped: list[tuple[ModuleType, str, Any]] = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == package or mod_name.startswith(package + ".")):
            continue
        for attr, value in list(vars(mod).items()):
            name = by_id.get(id(value))
            if name is not None and value is originals[name]:
                swapped.append((mod, attr, value))
                setattr(mod, attr, replacements[name])
    handle = Patch(module, swapped)
    _active[module] = handle
    return handle
