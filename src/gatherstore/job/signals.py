"""Clean up when a job is stopped from outside: SIGTERM (launchers) and SIGINT (Ctrl-C).

A launcher that stops a job (``gs.launch``, torchrun, SLURM) sends SIGTERM,
waits a grace period, then SIGKILL.  A rank then removes the job's areas in
its stores and ends as the default action would: SIGTERM kills the process
with that signal, SIGINT raises KeyboardInterrupt.  Handlers are installed
only where the program has not installed its own, and they act only while
they are the installed ones: a handler the program installs later wins, and
ours does nothing when that handler calls it as "the previous one".

A process forked from a rank (a DataLoader worker) gets the program's own
handlers back: a signal to it is not a signal to the rank.

Python runs signal handlers in the main thread between bytecodes, so a rank
blocked in a C++ wait (a store wait, a gloo op) would run its handler only
after the grace period.  A watcher thread, woken through ``signal.set_wakeup_fd``,
therefore cleans up at once and, for SIGTERM, ends the process with that
signal's default action right away (the launcher's grace period is not spent
waiting for a C++ call); for SIGINT the handler raises KeyboardInterrupt when
the main thread gets to it.  Without a free wakeup fd (e.g. asyncio holds
it) the handler alone cleans up.

Stop hooks (:func:`on_stop`: a result set flushing what it buffered) run first on
every SIGTERM/SIGINT, whichever handler is in charge: before the clean-up and the
default action where gatherstore's handler is installed; where the program handles
the signal itself, from the watcher as the signal arrives (the program's handler
runs in the main thread meanwhile), and in gatherstore's handler when the
program's calls it as the previous one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["forget_stop", "install", "on_stop", "uninstall"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_DEFAULTS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}

# cleanup, the handlers we replaced, the watcher's pipe and thread
_state: dict[str, Any] = {}
_lock = threading.Lock()
_stop_hooks: list[Callable[[], None]] = []
_hooks_lock = threading.Lock()


def install(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` once on SIGTERM/SIGINT, then end as the default handler would.

    Only in the main thread, and only for signals whose handler is still the default;
    a later call with another ``cleanup`` does nothing (the first one stays).
    """
    if "cleanup" in _state or threading.current_thread() is not threading.main_thread():
        return
    replaced = {
        sig: signal.signal(sig, _handle)
        for sig in _SIGNALS
        if signal.getsignal(sig) is _DEFAULTS[sig]
    }
    if not replaced:
        return
    _state.update(cleanup=cleanup, replaced=replaced, done=False)
    _start_watcher()


def on_stop(hook: Callable[[], None]) -> None:
    """Run ``hook`` first on every SIGTERM/SIGINT this process gets (see the module's
    docstring), until :func:`forget_stop`; from the main thread, the watcher starts
    here if it does not run yet."""
    if hook not in _stop_hooks:
        _stop_hooks.append(hook)
    _start_watcher()


def forget_stop(hook: Callable[[], None]) -> None:
    """Stop running ``hook`` on signals."""
    if hook in _stop_hooks:
        _stop_hooks.remove(hook)


def _run_stop_hooks() -> None:
    with _hooks_lock:
        for hook in list(_stop_hooks):
            with contextlib.suppress(Exception):  # best effort: the process is stopping
                hook()


def _start_watcher() -> None:
    """Watch the signals through the wakeup fd (only from the main thread, once)."""
    if "pipe" in _state or threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # someone else's (e.g. asyncio's): give it back
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return
    thread = threading.Thread(
        target=_watch, args=(read_end,), name="gatherstore-signals", daemon=True
    )
    _state.update(pipe=(read_end, write_end), thread=thread)
    thread.start()


def uninstall() -> None:
    """Put back the handlers ``install`` replaced and stop the watcher."""
    if not _state or threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in _state.get("replaced", {}).items():
        if signal.getsignal(sig) is _handle:
            signal.signal(sig, previous)
    if "pipe" in _state:
        read_end, write_end = _state["pipe"]
        current = signal.set_wakeup_fd(-1)
        if current != write_end:  # not ours any more: leave it be
            signal.set_wakeup_fd(current)
        os.close(write_end)  # the watcher reads EOF and ends
        _state["thread"].join(timeout=5)
        os.close(read_end)
    _state.clear()


def _in_forked_child() -> None:
    """A forked child (a DataLoader worker, say) is not the rank: it gets back the
    handlers and wakeup fd the program had, so that a signal to it neither removes the
    rank's areas nor reaches the rank's watcher through the shared pipe."""
    _stop_hooks.clear()
    if not _state:
        return
    with contextlib.suppress(ValueError):  # only the main thread may set handlers
        for sig, previous in _state.get("replaced", {}).items():
            if signal.getsignal(sig) is _handle:
                signal.signal(sig, previous)
        if "pipe" in _state:
            current = signal.set_wakeup_fd(-1)
            if current != _state["pipe"][1]:  # not ours any more: leave it be
                signal.set_wakeup_fd(current)
    for fd in _state.get("pipe", ()):
        with contextlib.suppress(OSError):
            os.close(fd)
    _state.clear()


os.register_at_fork(after_in_child=_in_forked_child)


def _ours(signum: int) -> bool:
    """Whether gatherstore's handler is still the one installed for ``signum``."""
    return signal.getsignal(signum) is _handle


def _run_cleanup() -> None:
    with _lock:
        if "cleanup" not in _state or _state["done"]:
            return
        _state["done"] = True
        with contextlib.suppress(Exception):  # best effort: the launcher sweeps too
            _state["cleanup"]()


def _watch(read_end: int) -> None:
    while True:
        try:
            data = os.read(read_end, 64)
        except OSError:
            return
        if not data:
            return
        if any(sig in data for sig in _SIGNALS):
            _run_stop_hooks()
        # a handler the program installed after ours is in charge: leave the signal to it
        mine = [sig for sig in _state.get("replaced", ()) if sig in data and _ours(sig)]
        if mine:
            _run_cleanup()
        if signal.SIGTERM in mine:
            _die(signal.SIGTERM)


def _die(signum: int) -> None:
    """End the process with ``signum``'s default action, from any thread.

    ``signal.signal`` only works in the main thread, which may be blocked in
    C++; libc's ``signal`` restores the default action from here.
    """
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signum, None)  # SIG_DFL
    os.kill(os.getpid(), signum)


def _handle(signum: int, frame: FrameType | None) -> None:
    _run_stop_hooks()
    if not _ours(signum):  # called by the program's own handler, which replaced ours
        return
    _run_cleanup()
    if signum == signal.SIGINT:
        _state["done"] = False  # the program may go on: clean up again next time
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
