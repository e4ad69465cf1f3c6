"""Swap a library's object functions for gatherstore's, in place, and undo it.

Written once for every compat module: the replacement lands on the defining
module and on every already-imported module of the same package that bound
the original by name (``from mmengine.dist import collect_results``); a module
imported while the patch is active binds the replacement from the defining
module.  Undoing puts the originals back wherever a replacement is bound.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType, TracebackType
from typing import Any

__all__ = ["Patch", "patch_module"]

_active: dict[str, Patch] = {}


def _bindings(package: str, objects: Mapping[int, str]) -> list[tuple[ModuleType, str, str]]:
    """(module, attribute, name) wherever a module of ``package`` binds one of ``objects``."""
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == package or mod_name.startswith(package + ".")):
            continue
        for attr, value in list(vars(mod).items()):
            name = objects.get(id(value))
            if name is not None:
                found.append((mod, attr, name))
    return found


class Patch:
    """The functions one ``patch()`` replaced; ``undo()`` (or leaving a ``with``) restores them."""

    def __init__(
        self,
        module: str,
        originals: Mapping[str, Callable[..., Any]],
        replacements: Mapping[str, Callable[..., Any]],
    ) -> None:
        self.module = module
        self.originals = dict(originals)
        self.replacements = dict(replacements)

    @property
    def active(self) -> bool:
        """Whether the replacements are still in place."""
        return _active.get(self.module) is self

    def _swap(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> int:
        """Bind ``new[name]`` wherever the package binds ``old[name]``; how many bindings."""
        package = self.module.split(".")[0]
        found = _bindings(package, {id(fn): name for name, fn in old.items()})
        for owner, attr, name in found:
            setattr(owner, attr, new[name])
        return len(found)

    def undo(self) -> None:
        """Put the originals back wherever a replacement is bound; again does nothing."""
        if not self.active:
            return
        self._swap(self.replacements, self.originals)
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
        return f"<gatherstore patch of {self.module}: {', '.join(self.replacements)}, {state}>"


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
    handle = Patch(module, originals, replacements)
    handle._swap(originals, replacements)
    _active[module] = handle
    return handle
