"""The pure logic of a call, without processes: the route decision, the facts every rank
agrees on, what a route needs of memory, the read-ahead window and the deadline."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import pytest

from gatherstore import InsufficientMemoryError
from gatherstore import _config as config
from gatherstore._time import MIN_TIMEOUT, REPORT_TIME, Deadline, time_left
from gatherstore.calls.choice import Facts, facts, pick, settle
from gatherstore.calls.fit import route_need
from gatherstore.routes.collective import CollectiveRoute
from gatherstore.routes.handchunks import WINDOW, ChunkedRoute
from gatherstore.routes.handover import HandoverRoute
from gatherstore.routes.parts import BATCH_BYTES, Window
from gatherstore.routes.store import StoreRoute
from gatherstore.stores.tmpdir import TmpdirStore

SMALL, LARGE = config.AUTO_THRESHOLD, config.AUTO_THRESHOLD + 1


# --- the route -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("total", "broken", "nodes", "route"),
    [
        (SMALL, "", 1, "collective"),  # small totals go over the process group
        (LARGE, "", 1, "tmpdir"),  # large ones through a tmpdir on one machine
        (LARGE, "", 2, "stream"),  # ... and point to point across machines
        (SMALL, "an earlier call broke it", 1, "tmpdir"),  # a broken gloo group is avoided
        (SMALL, "an earlier call broke it", 2, "stream"),  # (refused later: see settle)
    ],
)
def test_auto_picks_by_total_size_node_count_and_the_gloo_group(
    total: int, broken: str, nodes: int, route: str
) -> None:
    assert pick("auto", total=total, broken=broken, nodes=nodes, tmpdir_short=False) == route


def test_auto_takes_the_status_exchange_when_every_part_rode_on_it() -> None:
    assert pick("auto", total=SMALL, broken="", nodes=2, tmpdir_short=False, inlined=True) == (
        "inline"
    )
    broken = "an earlier call broke it"  # no gloo group needed
    assert pick("auto", total=SMALL, broken=broken, nodes=1, tmpdir_short=False, inlined=True) == (
        "inline"
    )
    # a route the user named is the route taken
    assert pick("collective", total=1, broken="", nodes=1, tmpdir_short=False, inlined=True) == (
        "collective"
    )


def test_the_default_tmpdir_leaves_dev_shm_when_the_gather_does_not_fit_there() -> None:
    elsewhere = f"tmpdir://{tempfile.gettempdir()}"
    for spec in ("tmpdir", TmpdirStore()):
        assert pick(spec, total=LARGE, broken="", nodes=1, tmpdir_short=True) == elsewhere
    assert pick("auto", total=LARGE, broken="", nodes=1, tmpdir_short=True) == elsewhere
    # a base the user chose is theirs: it stays
    chosen = TmpdirStore("/dev/shm/mine")
    assert pick(chosen, total=LARGE, broken="", nodes=1, tmpdir_short=True) is chosen
    assert pick("collective", total=LARGE, broken="", nodes=1, tmpdir_short=True) == "collective"


# --- the facts -------------------------------------------------------------------------------
def _status(size: int, *, node: str = "a", call: Any = "x", broken: str = "") -> dict[str, Any]:
    return {
        "ok": True,
        "size": size,
        "rebuilt": 0,
        "avail": 1 << 40,
        "window": 0,
        "shm": 1 << 40,
        "node": node,
        "call": call,
        "broken": broken,
    }


def test_facts_sum_every_rank_and_name_the_root_s_part() -> None:
    found = facts([_status(10), _status(30), _status(20, broken="why")], [0], root=2)
    assert found is not None
    assert (found.total, found.longest, found.root, found.broken) == (60, 30, 20, "why")
    assert found.short == {"collective": [], "shm": [], "memfd": [], "store": []}


def test_facts_are_none_when_a_rank_failed_or_ranks_are_in_different_calls() -> None:
    assert facts([_status(1), {"ok": False}], [0], root=0) is None
    assert facts([_status(1, call="a"), _status(1, call="b")], [0], root=0) is None


def test_a_node_short_of_memory_is_named_for_the_routes_it_cannot_take() -> None:
    statuses = [_status(1 << 30), _status(1 << 30, node="b")]
    statuses[0]["avail"] = 1 << 29  # half a GiB on node a, where dst reads
    found = facts(statuses, [0], root=0)
    assert found is not None
    assert found.short["store"] and "node a (rank 0) needs" in found.short["store"][0]
    assert found.short["collective"] and not any("node b" in s for s in found.short["store"])


def _handing(
    *tokens: str, receivers: Sequence[int] = (0,), limit: int = 1024, chunked: int = 0
) -> bool:
    statuses = [_status(1) for _ in tokens]
    for status, token in zip(statuses, tokens, strict=True):
        if token != "absent":
            status["hand"], status["hand_fds"] = token, limit
    for status in statuses[1 : 1 + chunked]:
        status["chunked"] = True
    found = facts(statuses, receivers, root=0)
    assert found is not None
    return found.handover


def test_parts_are_handed_over_only_when_every_rank_takes_them_in_one_place() -> None:
    assert _handing("h:1:0", "h:1:0", "h:1:0")
    assert not _handing("h:1:0", "h:1:0", "")  # one rank cannot (turned off, no memfd)
    assert not _handing("h:1:0", "absent")  # one rank's store could not be handed over
    assert not _handing("h:1:0", "g:1:0")  # another machine
    assert not _handing("h:1:0", "h:2:0")  # another network namespace
    assert not _handing("h:1:0", "h:1:1000")  # another user


def test_parts_are_handed_over_while_their_descriptors_fit_the_open_file_limit() -> None:
    nine = ["h:1:0"] * 9
    # a gather puts one descriptor per sender in flight, an all-gather W x (W - 1)
    assert _handing(*nine, limit=16)
    assert not _handing(*nine, receivers=range(9), limit=128)  # 72 > 64
    assert _handing(*nine, receivers=range(9), limit=144)
    # a part sent in chunks has up to WINDOW of them in flight
    assert _handing(*nine, limit=2 * (7 + WINDOW), chunked=1)
    assert not _handing(*nine, limit=2 * (7 + WINDOW) - 2, chunked=1)


def test_only_gatherstore_s_own_tmpdir_in_ram_is_handed_over(monkeypatch: Any) -> None:
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    short: dict[str, list[str]] = {"collective": [], "shm": [], "memfd": [], "store": []}
    found = Facts(total=LARGE, longest=LARGE, root=0, broken="", short=short, handover=True)
    ram = TmpdirStore()  # `tmpdir`: in /dev/shm where it is writable
    if not ram.shares_memory_with_host:
        pytest.skip("/dev/shm is not writable here")
    assert isinstance(settle(ram, found, what="gather_object", nodes=1), HandoverRoute)
    for store in (TmpdirStore("/dev/shm"), TmpdirStore(tempfile.gettempdir())):
        assert isinstance(settle(store, found, what="gather_object", nodes=1), StoreRoute)
    monkeypatch.setenv("GATHERSTORE_TMPDIR", "/dev/shm")  # a base the user named: files
    assert isinstance(settle(ram, found, what="gather_object", nodes=1), StoreRoute)
    monkeypatch.delenv("GATHERSTORE_TMPDIR")
    unable = dataclasses.replace(found, handover=False)
    assert isinstance(settle(ram, unable, what="gather_object", nodes=1), StoreRoute)


def test_handed_over_parts_need_ram_but_no_room_in_dev_shm(monkeypatch: Any) -> None:
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    if not TmpdirStore().shares_memory_with_host:
        pytest.skip("/dev/shm is not writable here")
    no_room = {"collective": [], "shm": ["a /dev/shm of 64 MiB"], "memfd": [], "store": []}
    found = Facts(total=LARGE, longest=LARGE, root=0, broken="", short=no_room, handover=True)
    # a container's small /dev/shm: the parts are handed over in RAM all the same
    assert isinstance(settle("tmpdir", found, what="gather_object", nodes=1), HandoverRoute)
    # ... where every rank can take them; else through the temp dir, as files
    files = settle("tmpdir", dataclasses.replace(found, handover=False), what="g", nodes=1)
    assert isinstance(files, StoreRoute) and str(files) == f"tmpdir://{tempfile.gettempdir()}"
    # short of RAM itself: files in the temp dir too
    no_ram = dict(no_room, memfd=["ranks [0, 1] on a need 2 GiB"])
    short = dataclasses.replace(found, short=no_ram)
    assert isinstance(settle("tmpdir", short, what="gather_object", nodes=1), StoreRoute)


def test_parts_in_chunks_are_a_branch_of_the_choice(monkeypatch: Any) -> None:
    """Sizes estimated from first chunks: handed over, the chunked route; on any route that
    does not hand chunks over, or when the estimates would not fit, None (every rank encodes
    its part whole and agrees again), where parts encoded whole raise or take that route."""
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    ram = TmpdirStore()
    if not ram.shares_memory_with_host:
        pytest.skip("/dev/shm is not writable here")
    fits: dict[str, list[str]] = {"collective": [], "shm": [], "memfd": [], "store": []}
    short = dict(fits, memfd=["ranks [0, 1] on a need 2 GiB"], store=["ranks [0] need 2 GiB"])
    whole = Facts(total=LARGE, longest=LARGE, root=0, broken="", short=fits, handover=True)
    chunked = dataclasses.replace(whole, chunked=True)
    rows = [  # (store, facts, the route's type or None)
        (ram, chunked, ChunkedRoute),
        (ram, dataclasses.replace(chunked, handover=False), None),  # a rank cannot take them
        (ram, dataclasses.replace(chunked, short=short), None),  # the estimates do not fit
        (TmpdirStore(tempfile.gettempdir()), chunked, None),  # files: never in chunks
        ("collective", dataclasses.replace(chunked, total=SMALL, longest=SMALL), None),
        (ram, whole, HandoverRoute),
        ("collective", dataclasses.replace(whole, total=SMALL, longest=SMALL), CollectiveRoute),
    ]
    for store, found, expected in rows:
        route = settle(store, found, what="gather_object", nodes=1)
        assert (route is None) if expected is None else type(route) is expected, (store, found)
    with pytest.raises(InsufficientMemoryError):  # parts encoded whole do not retry
        settle(
            TmpdirStore(tempfile.gettempdir()),
            dataclasses.replace(whole, short=short),
            what="gather_object",
            nodes=1,
        )


# --- what a route needs ----------------------------------------------------------------------
def test_route_needs_count_what_each_route_allocates_on_a_node() -> None:
    sizes = [100, 200, 300]
    collective = route_need("collective", sizes, [0], [0, 1, 2], all_receive=False)
    assert collective.ram == 300 * 3 + 300 + 300  # dst's W slots; each sender one padded part
    store = route_need("store", sizes, [0], [0, 1, 2], all_receive=False)
    assert (store.ram, store.shm) == (500, 0)  # dst's copies of the others' parts
    shm = route_need("shm", sizes, [0], [0, 1, 2], all_receive=False)
    assert (shm.ram, shm.shm) == (600, 600)  # the parts' files, freed as the copies arrive
    everyone = route_need("shm", sizes, [0, 1, 2], [0, 1, 2], all_receive=True)
    assert everyone.ram == 600 + (500 + 400 + 300)  # files stay until every rank has read
    streamed = route_need(
        "store", sizes, [0], [0], all_receive=False, windows=[50, 0, 0], iterated=True
    )
    assert streamed.ram == 300 + 50  # one part, the largest, and the read-ahead budget
    handed = route_need("memfd", sizes, [0, 1, 2], [0, 1, 2], all_receive=True)
    assert (handed.ram, handed.shm) == (600, 0)  # each part once, mapped by every reader
    rebuilt = route_need("memfd", sizes, [0], [0, 1, 2], all_receive=False, rebuilt=[0, 7, 9])
    assert rebuilt.ram == 600 + 16  # and what unpickling the others' parts allocates


# --- the read-ahead window -------------------------------------------------------------------
def test_the_window_requests_whole_batches_within_the_budget() -> None:
    window = Window(sizes=[0] + [10] * 40, budget=1000, in_flight=32, batch=16)
    todo = list(range(1, 41))
    assert window.next_requests(todo, set()) == [todo[:16], todo[16:32]]
    # once 32 are in flight nothing more; a consumer's part frees one slot: no short batch
    assert window.next_requests(todo[1:], set(todo[1:32])) == []
    # the budget binds first
    assert Window([0] + [10] * 40, 55, 32, 16).next_requests(todo, set()) == [todo[:5]]


def test_the_part_asked_for_is_requested_whatever_its_size() -> None:
    sizes = [0, 10, 5000, 10]
    window = Window(sizes, budget=100, in_flight=32, batch=16)
    assert window.next_requests([1, 2, 3], set()) == [[1]]  # 2 does not fit the budget
    assert window.next_requests([2, 3], set(), asked=2) == [[2, 3]]


def test_large_parts_go_one_request_each() -> None:
    big = BATCH_BYTES
    window = Window([0, big, big, big], budget=10 * big, in_flight=32, batch=16)
    assert window.next_requests([1, 2, 3], set()) == [[1], [2], [3]]


# --- the deadline ----------------------------------------------------------------------------
def test_a_deadline_counts_down_and_never_hands_out_a_zero_wait() -> None:
    deadline = Deadline.start(0.2)
    assert 0.1 < deadline.left() <= 0.2 and not deadline.passed()
    later = deadline.later(5.0)
    assert later.timeout == 0.2 and later.ends == deadline.ends + 5.0
    over = Deadline(1.0, time.monotonic() - 1)
    assert over.passed() and over.left() == MIN_TIMEOUT


def test_store_work_keeps_time_to_report_a_failure() -> None:
    deadline = Deadline.start(60.0)
    with deadline.for_store():
        left = time_left()
        assert left is not None and 60 - REPORT_TIME - 1 < left <= 60 - REPORT_TIME
    with Deadline.start(4.0).for_store():  # a short call keeps a quarter of it
        left = time_left()
        assert left is not None and 2 < left <= 3
    stale = Deadline(10.0, time.monotonic() - 5)  # half of it gone: whole=True gives it all
    with stale.for_store(whole=True):
        left = time_left()
        assert left is not None and 7 < left <= 10 - REPORT_TIME
    assert time_left() is None
