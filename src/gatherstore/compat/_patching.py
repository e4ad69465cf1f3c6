"""Swap a library's object functions for gatherstore's, in place, and undo it.

Written once for every compat module: the replacement lands on the defining
module and on every already-imported module of the same package that bound
the original by name (``from mmengine.dist import collect_results``).  A dotted
name replaces an attribute of the class that defines it instead, e.g.
``"metric.Metric._sync_dist"`` (submodules on the way are imported).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType, TracebackType
from typing import Any

__all__ = ["Patch", "import_library", "patch_module"]

_active: dict[str, Patch] = {}


class Patch:
    """The bindings one ``patch()`` replaced; ``undo()`` (or leaving a ``with``) restores them."""

    def __init__(self, module: str, swapped: list[tuple[Any, str, Any]]) -> None:
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


def import_library(module: str, pip_name: str) -> ModuleType:
    """``module``, imported.

    Raises:
        ImportError: it is not installed; the message has the ``pip install`` line.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"patch() needs {module}, which is not installed: pip install {pip_name}"
        ) from exc


def _member(target: ModuleType, dotted: str) -> tuple[Any, str]:
    """The class that itself defines the attribute ``dotted`` names, and the attribute's
    name; the path may go through submodules (imported as needed).

    Raises:
        AttributeError: a part of the path is missing, or the attribute is inherited.
    """
    *path, attr = dotted.split(".")
    owner: Any = target
    for part in path:
        if isinstance(owner, ModuleType) and not hasattr(owner, part):
            with contextlib.suppress(ImportError):
                importlib.import_module(f"{owner.__name__}.{part}")
        owner = getattr(owner, part)
    if attr not in vars(owner):
        raise AttributeError(f"{target.__name__}.{dotted} is not defined by {owner!r} itself")
    return owner, attr


def patch_module(
    module: str, pip_name: str, replacements: Mapping[str, Callable[..., Any]]
) -> Patch:
    """Replace ``module``'s functions named in ``replacements``, everywhere they are bound.

    Every module under the same top-level package that holds the very same
    function object gets the replacement too.  A dotted name ``"Class.attr"``
    replaces the attribute in ``Class.__dict__`` (methods are looked up on the
    class at call time, so instances made before the patch see it too).
    Patching an already patched module returns the active handle unchanged.

    Raises:
        ImportError: the library is not installed (names the pip package).
        AttributeError: ``module`` lacks a name to replace (an unsupported version).
    """
    if module in _active:
        return _active[module]
    target = import_library(module, pip_name)
    functions = {name: fn for name, fn in replacements.items() if "." not in name}
    members = [(_member(target, name), fn) for name, fn in replacements.items() if "." in name]
    originals = {name: getattr(target, name) for name in functions}
    swapped: list[tuple[Any, str, Any]] = []
    for (owner, attr), fn in members:
        swapped.append((owner, attr, vars(owner)[attr]))
        setattr(owner, attr, fn)
    by_id = {id(fn): name for name, fn in originals.items()}
    package = module.split(".")[0]
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == package or mod_name.startswith(package + ".")):
            continue
        for attr, value in list(vars(mod).items()):
            name = by_id.get(id(value))
            if name is not None and value is originals[name]:
                swapped.append((mod, attr, value))
                setattr(mod, attr, functions[name])
    handle = Patch(module, swapped)
    _active[module] = handle
    return handle
