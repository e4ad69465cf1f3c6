"""Swap a library's object functions for gatherstore's, in place, and undo it.

Written once for every compat module: a function's replacement lands on the
defining module and on every already-imported module of the same package that
bound the original by name (``from mmengine.dist import collect_results``); a
module imported while the patch is active binds the replacement from the
defining module, and undoing puts the originals back wherever a replacement is
bound.  A method's replacement lands on the defining class and on every
subclass that overrides it, including subclasses defined later (``lm_eval``'s
models load lazily).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType, TracebackType
from typing import Any

__all__ = ["Patch", "patch_methods", "patch_module"]

_active: dict[str, Patch] = {}
#: Marks a name the owner did not define itself: undo deletes it again.
_ABSENT = object()


def _bindings(
    packages: tuple[str, ...], objects: Mapping[int, str]
) -> list[tuple[ModuleType, str, str]]:
    """(module, attribute, name) wherever a module of ``packages`` binds one of ``objects``
    (keyed by ``id``; the objects are alive, so an equal id is the same object)."""
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.split(".")[0] not in packages:
            continue
        for attr, value in list(vars(mod).items()):
            name = objects.get(id(value))
            if name is not None:
                found.append((mod, attr, name))
    return found


class Patch:
    """The bindings one ``patch()`` replaced; ``undo()`` (or leaving a ``with``) restores them."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.swapped: list[tuple[ModuleType | type, str, Any]] = []
        # functions: (packages, originals, replacements), to restore late bindings too
        self.functions: tuple[tuple[str, ...], dict[str, Any], dict[str, Any]] | None = None

    def swap(self, owner: ModuleType | type, name: str, value: Any) -> None:
        """Bind ``owner.name`` to ``value``, remembering what ``owner`` itself held."""
        self.swapped.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    @property
    def active(self) -> bool:
        """Whether the replacements are still in place."""
        return _active.get(self.module) is self

    def undo(self) -> None:
        """Put every original binding back (in modules imported since, too); again does nothing."""
        if not self.active:
            return
        for owner, name, original in reversed(self.swapped):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        if self.functions is not None:
            packages, originals, replacements = self.functions
            by_id = {id(fn): name for name, fn in replacements.items()}
            for owner, attr, name in _bindings(packages, by_id):
                setattr(owner, attr, originals[name])
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
            f"gatherstore.compat needs {module}, which is not installed: pip install {pip_name}"
        ) from exc


def patch_module(
    module: str,
    pip_name: str,
    replacements: Mapping[str, Callable[..., Any]],
    also: tuple[str, ...] = (),
) -> Patch:
    """Replace ``module``'s functions named in ``replacements``, everywhere they are bound.

    Every module under the same top-level package, or under a package named in
    ``also`` (libraries that import the original by name), that holds the very
    same function object gets the replacement too.  Patching an already
    patched module returns the active handle unchanged.

    Raises:
        ImportError: the library is not installed (names the pip package).
        AttributeError: ``module`` lacks a name to replace (an unsupported version).
    """
    if module in _active:
        return _active[module]
    target = _import(module, pip_name)
    originals = {name: getattr(target, name) for name in replacements}
    packages = (module.split(".")[0], *also)
    handle = Patch(module)
    for owner, attr, name in _bindings(packages, {id(fn): n for n, fn in originals.items()}):
        handle.swap(owner, attr, replacements[name])
    handle.functions = (packages, originals, dict(replacements))
    _active[module] = handle
    return handle


def _family(root: type) -> list[type]:
    """``root`` and all its subclasses, each once."""
    found: list[type] = [root]
    for cls in found:  # grows while it is walked: breadth first
        subclasses: list[type] = cls.__subclasses__()
        found += [sub for sub in subclasses if sub not in found]
    return found


def patch_methods(
    module: str,
    pip_name: str,
    base: str,
    replacements: Mapping[str, Callable[..., Any]],
    overrides: bool = True,
) -> Patch:
    """Replace the methods of class ``module.base`` named in ``replacements``, and every override.

    Each subclass that defines one of these methods itself gets the replacement
    too, now and, through an ``__init_subclass__`` hook on ``base`` (removed by
    undo), when it is defined later; with ``overrides=False`` only ``base`` does
    (subclasses that override a method keep theirs).  Patching again returns the
    active handle.

    Raises:
        ImportError: the library is not installed (names the pip package).
        AttributeError: ``base`` or one of the methods is missing (an unsupported version).
    """
    key = f"{module}.{base}"
    if key in _active:
        return _active[key]
    root = getattr(_import(module, pip_name), base)
    for name in replacements:
        getattr(root, name)
    handle = Patch(key)

    def override(cls: type) -> None:
        for name, replacement in replacements.items():
            if name in vars(cls):
                handle.swap(cls, name, replacement)

    previous = vars(root).get("__init_subclass__")

    def init_subclass(cls: type, /, **kwargs: Any) -> None:
        if previous is None:
            super(root, cls).__init_subclass__(**kwargs)
        else:
            previous.__get__(None, cls)(**kwargs)
        override(cls)

    for cls in _family(root) if overrides else [root]:
        override(cls)
    if overrides:
        handle.swap(root, "__init_subclass__", classmethod(init_subclass))
    _active[key] = handle
    return handle
