"""What the layers above the job ask ``gs.shutdown()`` to do, without the job importing them.

Result sets write what they buffered while the process group still lives
(``before_group_ends``); the handover's listener is closed once it is gone.  A
module registers its hook when it is imported: a part of gatherstore a program
never used has nothing to end.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["at_shutdown", "run"]

_hooks: dict[bool, list[Callable[[], None]]] = {True: [], False: []}


def at_shutdown(hook: Callable[[], None], *, before_group_ends: bool = False) -> None:
    """Run ``hook`` at every ``gs.shutdown()``: before the ranks meet and the group ends
    (``before_group_ends``), or after."""
    if hook not in _hooks[before_group_ends]:
        _hooks[before_group_ends].append(hook)


def run(*, before_group_ends: bool) -> None:
    """Run the hooks of one phase, in the order they were registered."""
    for hook in list(_hooks[before_group_ends]):
        hook()
