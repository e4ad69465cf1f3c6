"""Where in a rank's object the thing that cannot be pickled is, in one process: the
search (``gatherstore.codec.culprit``) and the errors of the encoders that name it."""

from __future__ import annotations

import gc
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import gatherstore as gs
from gatherstore.codec import chunks, culprit
from gatherstore.codec import frames as serialize

LOCK = threading.Lock()
THE_LOCK = f"a {type(LOCK)!r}"


def _path(obj: Any, **bounds: Any) -> str:
    found = culprit.find(obj, **bounds)
    assert found is not None
    assert found.what == THE_LOCK, found
    return found.path


@dataclass
class Hook:
    fn: Any
    name: str = "hook"


@dataclass
class Model:
    weights: torch.Tensor
    hook: Hook


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, b: Any) -> None:
        self.a = np.arange(3)
        self.b = b


class Carried:
    """Raises a rank's own error when pickled (as ``gatherstore.compat``'s ``Raising``)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        raise self.error


class Refusing:
    """Its own reduction fails, whatever it holds."""

    def __init__(self) -> None:
        self.fine = 1

    def __reduce__(self) -> Any:
        raise TypeError("Refusing objects are not for pickling")


def _generator() -> Iterator[int]:
    yield 1


def test_lists_and_dicts() -> None:
    assert _path({"results": [1, 2, {"mask": LOCK}]}) == "obj['results'][2]['mask']"
    assert _path([[0], (1, [2, LOCK])]) == "obj[1][1][1]"
    assert _path({(1, "a"): {7: LOCK}}) == "obj[(1, 'a')][7]"


def test_nested_dataclasses_and_attributes() -> None:
    obj = {"model": Model(torch.zeros(3), Hook(fn=LOCK))}
    assert _path(obj) == "obj['model'].hook.fn"
    module = torch.nn.Linear(2, 2)
    module.hook = LOCK  # type: ignore[assignment]  # a plain attribute, not a submodule
    assert _path([module]) == "obj[0].hook"


def test_slots() -> None:
    assert _path({"s": Slotted(LOCK)}) == "obj['s'].b"


def test_keys_and_set_elements() -> None:
    assert _path({"tags": {1, LOCK}}) == "obj['tags'] (an element)"
    assert _path({"index": {LOCK: 1}}).startswith("obj['index'] (its key <unlocked _thread.lock")


@pytest.mark.parametrize(
    ("obj", "what"),
    [
        ({"fn": lambda: LOCK}, "a lambda"),  # cloudpickle fails on its closure
        ({"gen": _generator()}, "a <class 'generator'>"),
        ({"refusing": Refusing()}, f"a {Refusing!r}"),
    ],
)
def test_what_the_culprit_is(obj: dict[str, Any], what: str) -> None:
    found = culprit.find(obj)
    assert found is not None and found.what == what


def test_a_socket() -> None:
    with socket.socket() as sock:
        found = culprit.find({"conn": [sock]})
    assert found is not None
    assert (found.path, found.what) == ("obj['conn'][0]", "a <class 'socket.socket'>")


def test_cycles_end() -> None:
    a: dict[str, Any] = {"x": 1}
    b: dict[str, Any] = {"a": a}  # tried first: its way back to ``a`` is no failure of its own
    a["b"], a["lock"] = b, LOCK
    assert _path(a) == "obj['lock']"
    ring: list[Any] = []
    ring.append(ring)
    ring.append({"ring": ring, "deep": [ring, LOCK]})
    assert _path(ring) == "obj[1]['deep'][1]"


def test_a_huge_list_is_halved_and_the_search_bounded() -> None:
    huge: list[dict[str, Any]] = [{"i": i} for i in range(100_000)]
    huge[73_457] = {"i": LOCK}
    start = time.monotonic()
    assert _path({"results": huge}) == "obj['results'][73457]['i']"
    assert time.monotonic() - start < culprit.SECONDS + 1
    found = culprit.find({"results": huge}, tries=5)
    assert found is not None and found.what is None and found.path == "obj['results']"
    assert str(found).startswith("somewhere in obj['results'] is something neither pickle")
    assert "after 5 tries" in str(found)
    found = culprit.find({"results": huge}, depth=1)
    assert found is not None and found.what is None and "at a depth of 1" in str(found)
    found = culprit.find({"results": huge}, seconds=0.0)
    assert found is not None and found.what is None and "after 0 s" in str(found)


def test_arrays_and_tensors_are_not_tried() -> None:
    """pickle refuses a tensor that requires grad and is no leaf; the encoder detaches it."""
    grown = torch.ones(3, requires_grad=True) * 2
    obj = {"t": grown, "x": np.zeros(1 << 20), "bad": LOCK}
    assert _path(obj) == "obj['bad']"
    assert _path({"objects": np.array([1, LOCK], dtype=object)}).startswith("obj['objects']")


def test_an_error_the_object_carries_is_left_as_it_is() -> None:
    error = ValueError("rank 1's own error")
    assert culprit.find({"outcome": [Carried(error)]}, error) is None
    error = ValueError("rank 1's own error")
    with pytest.raises(ValueError) as caught:
        serialize.encode({"outcome": [Carried(error)]})
    assert caught.value is error and str(error) == "rank 1's own error"
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    assert "encode" in names and "fails" not in names, "the search's frames are not its own"


def test_encode_names_the_path_and_keeps_the_error() -> None:
    with pytest.raises(TypeError) as caught:
        serialize.encode({"results": [1, 2, {"mask": LOCK}]})
    message = str(caught.value)
    assert message.startswith("cannot pickle '_thread.lock' object — at ")
    assert "obj['results'][2]['mask']: a <class '_thread.lock'>, which neither" in message
    assert "put something picklable in its place" in message


def test_encode_of_the_culprit_itself_says_what_pickle_says() -> None:
    with pytest.raises(TypeError) as caught:
        serialize.encode(LOCK)
    assert str(caught.value) == "cannot pickle '_thread.lock' object"


@pytest.fixture()
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunks, "CHUNK", 1 << 20)
    monkeypatch.setattr(chunks, "MIN_PART", 4 << 20)


def _long_list(bad: Any, at: int) -> list[Any]:
    items: list[Any] = [{"id": i, "logits": np.full(64, i, np.float32)} for i in range(40_000)]
    items[at] = {"id": at, "extra": [bad]}
    return items


@pytest.mark.usefixtures("small_chunks")
def test_chunks_name_the_path_of_an_item_that_raises() -> None:
    class Raises:
        def __reduce__(self) -> Any:
            raise ValueError("no pickling this")

    run = chunks.Chunks.first(_long_list(Raises(), 30_000))
    assert run is not None
    with pytest.raises(ValueError) as caught:
        list(run.rest())
    assert str(caught.value).startswith("no pickling this — at obj[30000]['extra'][0]: a ")


@pytest.mark.usefixtures("small_chunks")
def test_a_list_sent_whole_after_its_chunks_names_the_path() -> None:
    items = _long_list(LOCK, 30_000)
    run = chunks.Chunks.first(items)
    assert run is not None
    with pytest.raises(chunks.Unchunkable):
        list(run.rest())
    with pytest.raises(TypeError, match=r"at obj\[30000\]\['extra'\]\[0\]: a <class '_thread"):
        serialize.encode(items)


# --- asked before encoding: check_picklable ------------------------------------------------------
@pytest.mark.parametrize(
    "obj",
    [
        {"id": 1, "score": np.float32(0.5), "boxes": np.zeros((100, 4)), "name": "img-1"},
        [1, 2.5, None, b"x", (True, 3j), {"t": torch.ones(3, requires_grad=True) * 2}],
        list(range(10_000)),  # longer than a glance: pickled into nothing
        [[[[[["deeper than a glance"]]]]]],
        Hook(fn=len),  # an instance: pickled into nothing
        {"fn": lambda x: x + 1},  # only cloudpickle can: kept, as the encoder does
    ],
    ids=["plain", "atoms", "long", "deep", "instance", "cloudpickle"],
)
def test_what_pickles_passes(obj: Any) -> None:
    culprit.check_picklable(obj)
    serialize.encode(obj)  # and the encoder agrees


@pytest.mark.parametrize(
    ("obj", "path"),
    [
        ({"score": 0.5, "extra": [1, {"mask": LOCK}]}, "value['extra'][1]['mask']"),
        ([0] * 100 + [LOCK], "value[100]"),  # longer than a glance
        ([[[[[[LOCK]]]]]], "value[0][0][0][0][0][0]"),  # deeper than a glance
        (Hook(fn=LOCK), "value.fn"),
        ({"objects": np.array([1, LOCK], dtype=object)}, "value['objects']"),
    ],
    ids=["nested", "long", "deep", "attribute", "object-array"],
)
def test_what_does_not_pickle_raises_pickle_s_error_naming_the_path(obj: Any, path: str) -> None:
    with pytest.raises(TypeError) as caught:
        culprit.check_picklable(obj, "value")
    message = str(caught.value)
    assert message.startswith("cannot pickle '_thread.lock' object — at ")
    assert f"at {path}" in message


def test_a_failed_check_leaves_the_thread_s_pickler_as_it_was() -> None:
    """The pickler a thread keeps is reused: a failure in the middle of an object must
    neither keep that object nor fail the next one; another thread has its own."""
    instance = Hook(fn=len)
    alive = weakref.ref(instance)
    held = {"big": "x" * 100_000, "instance": instance, "mask": LOCK}
    with pytest.raises(TypeError):
        culprit.check_picklable(held)
    del held, instance
    gc.collect()
    assert alive() is None  # nothing of it is kept
    culprit.check_picklable([Hook(fn=len)] * 3)
    failures: list[BaseException] = []

    def check_many() -> None:
        try:
            for _ in range(200):
                culprit.check_picklable([Hook(fn=len), {"n": 1}] * 40)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=check_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_one_process_sends_nothing_so_pickles_nothing() -> None:
    """Documented (docs/guarantees.md): a world of one returns the object itself, as the
    libraries the drop-ins replace do; an unpicklable object fails once it travels."""
    assert gs.all_gather_object(LOCK)[0] is LOCK
    assert gs.gather_object({"mask": LOCK}) == [{"mask": LOCK}]
    assert gs.broadcast_object(LOCK) is LOCK
