"""The handover's memfds and socket, one piece alone in a one-rank group: a part is sealed
before it leaves and checked when it is taken; late parts are dropped; a part from another
user is refused; a part that fails as it is sealed leaves no memfd.  The handover between
ranks, through the collectives, is test_handover.py's."""

from __future__ import annotations

import fcntl
import gc
import logging
import mmap
import os
import resource
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import OtherUser
from test_handover import _open_parts

import gatherstore as gs
from gatherstore._time import Deadline
from gatherstore.codec import digest as _digest
from gatherstore.codec import frames as serialize
from gatherstore.routes import handover


def _one_rank_group(tmp_path: Path) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1
    )


def test_a_handed_over_part_cannot_change(tmp_path: Path) -> None:
    """The memfd is sealed before it leaves: nobody, its sender included, can write,
    truncate or share-map it for writing; the reader's mapping is its own."""
    _one_rank_group(tmp_path)
    try:
        assert handover.token(30)  # listening, and named on the rendezvous store
        frame = serialize.encode({"x": torch.arange(1000)})
        handover.hand(frame, b"bind", [0], "call-1", Deadline.start(30))
        fds = handover.take("call-1", [0], Deadline.start(30), "test")
        fd = fds[0]
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, frame.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        with pytest.raises(PermissionError):  # the seals themselves are sealed
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)
        view = handover.mapped(os.dup(fd), frame.nbytes, 0, "test")
        view[-1] ^= 0xFF  # a private copy: the memfd is unchanged, the check sees it
        with pytest.raises(gs.IntegrityError):
            serialize.verify(view, bind=b"bind", rank=0)
        again = handover.mapped(fd, frame.nbytes, 0, "test")
        assert serialize.load(serialize.verify(again, bind=b"bind"))["x"].sum() == 499500
    finally:
        handover.close()
        torch.distributed.destroy_process_group()


def test_an_unsealed_or_resized_memfd_is_refused(tmp_path: Path) -> None:
    fd = os.memfd_create("plain", os.MFD_ALLOW_SEALING)
    os.write(fd, b"x" * 64)
    with pytest.raises(gs.IntegrityError, match="unsealed"):
        handover.mapped(fd, 64, 3, "gather_object")
    fd = os.memfd_create("short", os.MFD_ALLOW_SEALING)
    os.write(fd, b"x" * 64)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    with pytest.raises(gs.IntegrityError, match="agreed: 128"):
        handover.mapped(fd, 128, 3, "gather_object")


def test_late_parts_are_dropped_and_a_new_group_listens_anew(tmp_path: Path) -> None:
    """A part handed over after its call ended waits for nobody: the next call drops it
    before it agrees; a new process group gets a socket of its own, the old one closed."""
    _one_rank_group(tmp_path)
    try:
        handover.token(30)
        frame = serialize.encode("late")
        handover.hand(frame, b"", [0], "call-3", Deadline.start(30))
        handover.token(30)  # the next call: nothing of it can be there yet
        with pytest.raises(gs.GatherTimeout, match=r"the parts of rank 0 were never handed over"):
            handover.take("call-3", [0], Deadline.start(0.2), "gather_object")
        assert handover._listener is not None
        old = handover._listener.name
    finally:
        torch.distributed.destroy_process_group()
    (tmp_path / "again").mkdir()
    _one_rank_group(tmp_path / "again")
    try:
        handover.token(30)
        assert handover._listener is not None and handover._listener.name != old
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with conn, pytest.raises(ConnectionRefusedError):
            conn.connect(old)
    finally:
        handover.close()
        torch.distributed.destroy_process_group()


def test_descriptors_past_1024_are_fine(tmp_path: Path) -> None:
    """A process with many files open: its socket's descriptor number is past select()'s
    reach, and parts are taken all the same."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip("the open-file limit is below 1200 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    _one_rank_group(tmp_path)
    try:
        assert handover.token(30)
        assert handover._listener is not None and handover._listener.sock.fileno() >= 1024
        frame = serialize.encode({"x": torch.arange(10)})
        handover.hand(frame, b"", [0], "call-9", Deadline.start(30))
        fds = handover.take("call-9", [0], Deadline.start(30), "test")
        assert fcntl.fcntl(fds[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # never inherited
        view = handover.mapped(fds[0], frame.nbytes, 0, "test")
        assert serialize.load(serialize.verify(view))["x"].sum() == 45
    finally:
        handover.close()
        torch.distributed.destroy_process_group()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_INTRUDER = """
import json, os, socket, sys
fd = os.memfd_create("forged")
os.write(fd, b"forged")
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect(bytes.fromhex(sys.argv[1]))
socket.send_fds(conn, [json.dumps({"call": "call-7", "rank": 0}).encode()], [fd])
conn.close()
"""


def test_a_part_from_another_user_is_refused(
    tmp_path: Path, other_user: OtherUser, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user can reach an abstract socket: what it hands over is dropped, and the
    rank's own part is taken."""
    _one_rank_group(tmp_path)
    try:
        assert handover.token(30)
        assert handover._listener is not None
        name = handover._listener.name
        python = shutil.which("python3", path="/usr/bin:/bin")  # one another user may run
        if python is None:
            pytest.skip("no system python3 for another user to run")
        other_user.run(python, "-c", _INTRUDER, name.hex())
        frame = serialize.encode("mine")
        handover.hand(frame, b"", [0], "call-7", Deadline.start(30))
        with caplog.at_level(logging.WARNING, logger="gatherstore"):
            fds = handover.take("call-7", [0], Deadline.start(30), "test")
        view = handover.mapped(fds[0], frame.nbytes, 0, "test")
        assert serialize.load(serialize.verify(view)) == "mine"
        assert "another user refused" in caplog.text
    finally:
        handover.close()
        torch.distributed.destroy_process_group()


def test_a_part_that_fails_as_it_is_sealed_leaves_no_memfd_and_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory while the checksum runs: that error, not a failure to unmap what the
    error's traceback still views, and the memfd is closed."""
    _one_rank_group(tmp_path)
    try:

        def exhausted(*_: Any) -> Any:
            raise MemoryError("no room for the checksum's blocks")

        monkeypatch.setattr(_digest, "_blocks", exhausted)
        frame = serialize.encode([np.full(100, i, np.float32) for i in range(2000)])
        before = _open_parts()
        with pytest.raises(MemoryError, match="checksum's blocks"):
            handover.sealed(frame, b"bind")
        gc.collect()  # the error's traceback, which viewed the mapping
        assert _open_parts() == before
    finally:
        torch.distributed.destroy_process_group()
