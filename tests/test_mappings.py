"""Handed-over parts' mappings: unmapped by threads of the process once nothing views
them, and never more memory held than unmapping at once would hold.

Real memfds and real mappings, read back from /proc/self/maps; a real fork and a real
interpreter exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gatherstore as gs
from gatherstore.host import mappings, memory


def _part(name: str, size: int = 4 << 20) -> memoryview:
    """A memfd of ``size`` bytes named ``name``, mapped as handed-over parts are."""
    fd = os.memfd_create(name)
    try:
        os.write(fd, bytes(size))
        view = mappings.map_private(fd, size)
    finally:
        os.close(fd)
    view[0] = 1  # a private page of this process's own, as decoding writes them
    return view


def _mapped(name: str) -> bool:
    return f"/memfd:{name} (deleted)" in Path("/proc/self/maps").read_text()


def _let_go(name: str) -> list[str]:
    """Map 256 MiB of parts and drop them (unmapping them takes a while); their names."""
    names = [f"{name}-{k}" for k in range(32)]
    views = [_part(n, 8 << 20) for n in names]
    del views
    return names


def test_a_part_nothing_views_is_unmapped_by_a_thread_then_waited_for() -> None:
    view = _part("gs-test-dropped")
    assert _mapped("gs-test-dropped")
    del view
    assert any(t.name == "gatherstore-unmap" for t in threading.enumerate())
    mappings.drained()
    assert not _mapped("gs-test-dropped")


def test_mapping_a_part_first_waits_for_every_unmapping_handed_off() -> None:
    names = _let_go("gs-test-let-go")
    kept = _part("gs-test-next")
    assert not any(_mapped(name) for name in names)
    assert _mapped("gs-test-next")
    del kept


def test_the_headroom_is_measured_once_the_parts_let_go_are_unmapped() -> None:
    names = _let_go("gs-test-headroom")
    assert memory.headroom() > 0
    assert not any(_mapped(name) for name in names)


def test_shutdown_leaves_no_part_to_unmap() -> None:
    names = _let_go("gs-test-shutdown")
    gs.shutdown()  # no process group: only what a process holds of its own
    assert not any(_mapped(name) for name in names)


def test_beyond_what_the_threads_may_be_left_the_program_unmaps_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mappings.drained()
    monkeypatch.setattr(mappings, "BEHIND", (4 << 20) - 1)  # less than one part
    view = _part("gs-test-inline")
    del view
    assert not _mapped("gs-test-inline")  # unmapped in the ``del``, no waiting


@pytest.mark.timeout(60)
def test_a_forked_child_never_holds_a_part_its_parent_let_go() -> None:
    read, write = os.pipe()
    names = _let_go("gs-test-before-fork")  # handed to the threads; the fork waits for them
    pid = os.fork()
    if pid == 0:  # the child: unmaps with threads of its own
        try:
            inherited = any(_mapped(name) for name in names)
            own = _part("gs-test-in-child")
            del own
            mappings.drained()
            os.write(write, bytes([inherited, _mapped("gs-test-in-child")]))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        found = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert found == bytes([False, False])


_COLLECTED_UNDER_THREADINGS_LOCK = """
import gc, os, threading
from gatherstore.host import mappings as _mappings

def part(name):
    fd = os.memfd_create(name); os.write(fd, bytes(1 << 20))
    view = _mappings.map_private(fd, 1 << 20); os.close(fd)
    return view

class Cycle: pass
gc.disable()
cycle = Cycle(); cycle.me = cycle; cycle.view = part("cycle")  # freed by a collection only
del cycle
dropped = [part("dropped")]
held = threading.Event()

def collect():  # as threading.enumerate() would, were a collection to run inside it
    with threading._active_limbo_lock:
        held.set()
        threading.Event().wait(0.2)
        gc.collect()

def drop():
    held.wait()
    dropped.clear()

threads = [threading.Thread(target=drop), threading.Thread(target=collect)]  # in this order
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
_mappings.drained()
print("done")
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(threading, "_active_limbo_lock"), reason="CPython's lock")
def test_a_part_let_go_while_threading_holds_its_lock_does_not_deadlock() -> None:
    """A finalizer may run in a collection inside threading's own lock: handing a part
    off never starts a thread (that lock again), so two threads never wait on each other."""
    script = _COLLECTED_UNDER_THREADINGS_LOCK
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"done\n"


@pytest.mark.timeout(60)
def test_an_interpreter_exits_with_a_part_still_to_unmap() -> None:
    script = (
        "import os\n"
        "from gatherstore.host import mappings as _mappings\n"
        "fd = os.memfd_create('exit'); os.write(fd, bytes(64 << 20))\n"
        "views = [_mappings.map_private(fd, 64 << 20) for _ in range(8)]\n"
        "os.close(fd)\n"
        "del views\n"
        "print('done')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"done\n"
