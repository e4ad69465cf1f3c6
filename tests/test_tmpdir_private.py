"""A tmpdir base another local user controls is refused; a swapped job folder is detected.

The other user is a real second account (created by the ``other_user`` fixture) whose
real processes create the base first in a sticky folder, plant symlinks, and swap the
job's folder; the job is a real ``gs.launch`` job or the store's own job hooks.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import OtherUser

import gatherstore as gs


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh folder like /dev/shm: root's, world-writable and sticky (mode 1777)."""
    top = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path("/tmp")
    path = top / f"gstest-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _gather_into(base: str) -> str:
    """One rank: gather through ``tmpdir:///<base>``; the error's class and message."""
    try:
        gs.all_gather_object(gs.get_rank(), store=f"tmpdir://{base}", timeout=60)
    except gs.GatherError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "gathered"


@pytest.mark.timeout(180)
def test_a_base_another_user_created_first_is_refused_on_every_rank(
    shm: Path, other_user: OtherUser, gatherstore_run: Any
) -> None:
    base = shm / "gather"  # a predictable GATHERSTORE_TMPDIR
    other_user.run("mkdir", "-m", "0777", str(base))
    results = gatherstore_run(_gather_into, 2, str(base), timeout=120)
    for text in results:
        assert text.startswith("StoreUnavailableError"), text
        assert f"{base} is owned by {other_user.name}" in text
        assert "mkdir -m 700" in text  # the fix
    assert list(base.iterdir()) == []  # nothing of the job went there


def test_a_base_open_to_others_without_sticky_bit_is_refused(shm: Path) -> None:
    base = shm / "open"
    base.mkdir()
    base.chmod(0o777)
    with pytest.raises(
        gs.StoreUnavailableError, match=r"writable by group and others \(mode 777\)"
    ):
        gs.open_store(f"tmpdir://{base}").prepare_job("0123456789abcdef")
    base.chmod(0o1777)  # sticky, like /dev/shm: others cannot rename the job's folder
    store = gs.open_store(f"tmpdir://{base}")
    store.end_job(store.prepare_job("0123456789abcdef"))
    assert list(base.iterdir()) == []


def test_symlinked_bases_another_user_planted_are_refused(shm: Path, other_user: OtherUser) -> None:
    theirs = shm / "theirs"
    other_user.run("mkdir", "-m", "0777", str(theirs))
    # a symlink of theirs in a sticky folder
    other_user.run("ln", "-s", str(theirs), str(shm / "link"))
    with pytest.raises(gs.StoreUnavailableError, match=f"{shm / 'link'} is a symlink owned by"):
        gs.open_store(f"tmpdir://{shm / 'link'}").prepare_job("0123456789abcdef")
    # a folder their group can write, without the sticky bit: a symlink there is theirs to plant
    shared = shm / "group"
    shared.mkdir()
    os.chown(shared, 0, other_user.gid)
    shared.chmod(0o775)
    other_user.run("ln", "-s", str(theirs), str(shared / "base"))
    with pytest.raises(gs.StoreUnavailableError) as info:
        gs.open_store(f"tmpdir://{shared / 'base'}").prepare_job("0123456789abcdef")
    assert f"{shared} is writable by its group" in str(info.value)
    assert list(theirs.iterdir()) == []


@pytest.fixture
def job_area(shm: Path) -> tuple[Path, gs.Store, str, gs.Store]:
    """A tmpdir base of this user's in ``shm``, its store, a job area's locator and store."""
    base = shm / "base"
    base.mkdir(mode=0o755)
    store = gs.open_store(f"tmpdir://{base}")
    locator = store.prepare_job("0123456789abcdef")
    return base, store, locator, store.join_job(locator)


def _swap(other_user: OtherUser, base: Path, locator: str) -> None:
    """The base became writable by others (a mistake), after the check: the other user
    moves the job's folder aside and puts a folder of theirs in its place."""
    base.chmod(0o777)
    other_user.run("mv", locator, f"{base}/moved-away")
    other_user.run("mkdir", "-m", "0777", locator)


def test_a_swapped_job_folder_is_detected_and_never_used(
    job_area: tuple[Path, gs.Store, str, gs.Store], other_user: OtherUser
) -> None:
    base, store, locator, area = job_area
    area.put("call-1/0", b"before")
    _swap(other_user, base, locator)

    area.put("call-2/0", b"after")  # the job keeps working in its own folder
    assert bytes(area.get("call-2/0") or b"") == b"after"
    assert list(Path(locator).iterdir()) == []  # nothing went into theirs
    with pytest.raises(gs.StoreUnavailableError) as info:
        store.join_job(locator)  # a rank that opens the area now refuses it
    message = str(info.value)
    assert f"the job folder {locator} is not the one this job created" in message
    assert f"owned by {other_user.name}" in message and "mkdir -m 700" in message
    with pytest.raises(gs.StoreUnavailableError, match="was replaced by another folder"):
        store.end_job(locator)
    assert sorted(p.name for p in base.iterdir()) == [Path(locator).name]  # theirs, alone
    assert Path(locator).stat().st_uid == other_user.uid


def test_a_pickled_job_area_keeps_its_checks(
    job_area: tuple[Path, gs.Store, str, gs.Store], other_user: OtherUser
) -> None:
    base, _, locator, area = job_area
    area.put("call-1/0", b"mine")
    clone = pickle.loads(pickle.dumps(area))  # as a store travels to a worker process
    assert bytes(clone.get("call-1/0") or b"") == b"mine"
    assert clone.sign_parts == area.sign_parts
    # the folder is replaced by another user's: an area unpickled now refuses it, as a rank
    # that joins it does (a plain folder store would follow it)
    _swap(other_user, base, locator)
    base.chmod(0o755)
    with pytest.raises(gs.StoreUnavailableError, match="is not the one this job created"):
        pickle.loads(pickle.dumps(area))
    # ... and so does one that a symlink points elsewhere
    os.rmdir(locator)
    os.symlink(f"{base}/moved-away", locator)
    with pytest.raises(gs.StoreUnavailableError):
        pickle.loads(pickle.dumps(area))
