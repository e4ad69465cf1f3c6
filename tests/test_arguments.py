"""Bad arguments fail the same way in one process as in a group: a ValueError naming the
argument and what it must be, before anything is sent (a typo shows up on a laptop, not
hours later on a cluster), and the group goes on."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gatherstore as gs

#: (label, the call, words the error must say)
BAD: list[tuple[str, Callable[[], Any], str]] = [
    ("unknown scheme", lambda: gs.all_gather_object(1, store="nosuchscheme://x"), "nosuchscheme"),
    ("relative file URL", lambda: gs.gather_object(1, store="file://shared"), "absolute path"),
    (
        "a path",
        lambda: gs.all_gather_object(1, store="/scratch/x"),
        "give its URL, file:///scratch/x",
    ),
    ("relative path", lambda: gs.gather_object(1, store="./x"), Path("x").absolute().as_uri()),
    ("negative timeout", lambda: gs.gather_iter(1, timeout=-1), "positive"),
    ("zero timeout", lambda: gs.all_gather_object(1, timeout=0), "positive"),
    ("NaN timeout", lambda: gs.broadcast_object(1, timeout=math.nan), "positive"),
    ("infinite timeout", lambda: gs.gather_object(1, timeout=math.inf), "finite"),
    ("text timeout", lambda: gs.all_gather_object(1, timeout="10"), "timeout='10'"),
    ("dst outside", lambda: gs.gather_object(1, dst=5), "dst=5"),
    ("dst not an int", lambda: gs.gather_iter(1, dst=0.0), "dst=0.0"),
    ("src outside", lambda: gs.broadcast_object(1, src=-1), "src=-1"),
    ("negative read_ahead", lambda: gs.gather_iter(1, read_ahead=-1), "read_ahead=-1"),
    ("progress not a bool", lambda: gs.all_gather_object(1, progress="yes"), "progress='yes'"),
    ("collect_results dst", lambda: gs.collect_results([1], dst=3), "dst=3"),
    ("collect_results order", lambda: gs.collect_results([1], order="random"), "random"),
    ("barrier NaN", lambda: gs.barrier(timeout=math.nan), "positive"),
    ("barrier infinite", lambda: gs.barrier(timeout=math.inf), "finite"),
]


def _outcomes() -> list[tuple[str, str, bool]]:
    """(label, the error's class, whether it says the words) for every bad call."""
    out = []
    for label, call, words in BAD:
        try:
            call()
            out.append((label, "nothing raised", False))
        except Exception as exc:
            out.append((label, type(exc).__name__, words in str(exc)))
    return out


def _in_a_group() -> dict[str, Any]:
    return {"outcomes": _outcomes(), "after": gs.all_gather_object(gs.get_rank(), timeout=30)}


@pytest.mark.parametrize(("label", "call", "words"), BAD, ids=[b[0] for b in BAD])
def test_serially(label: str, call: Callable[[], Any], words: str) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value), str(info.value)


@pytest.mark.timeout(120)
def test_in_a_group_every_rank_raises_the_same_and_goes_on() -> None:
    results = gs.launch(_in_a_group, nproc_per_node=2, backend="gloo", timeout=60)
    expected = [(label, "ValueError", True) for label, _, _ in BAD]
    for out in results:
        assert out["outcomes"] == expected
        assert out["after"] == [0, 1]


def test_a_path_as_a_store_is_refused_with_its_url() -> None:
    with pytest.raises(ValueError) as info:
        gs.open_store("/scratch/my dir")
    assert str(info.value) == (
        "store '/scratch/my dir' is a path, not a store URL: give its URL, file:///scratch/my%20dir"
    )
    with pytest.raises(ValueError, match="file:///"):
        gs.set_default_store("~/results")


@pytest.mark.parametrize(
    ("spec", "package", "hint"),
    [
        ("s3://bucket/prefix", "s3fs", "pip install 'gatherstore[s3]'"),
        ("simplecache::s3://bucket/prefix", "s3fs", "pip install 'gatherstore[s3]'"),
        ("gs://bucket/prefix", "gcsfs", "pip install gcsfs"),
        ("az://container/prefix", "adlfs", "pip install adlfs"),
        ("redis://localhost:6379/0", "redis", "pip install redis"),
    ],
)
def test_a_missing_store_package_is_one_sentence_with_its_pip_line(
    monkeypatch: pytest.MonkeyPatch, spec: str, package: str, hint: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "gatherstore.stores.redis", raising=False)
    fsspec_registry = importlib.import_module("fsspec.registry")
    for protocol in ("s3", "gs", "az"):  # classes fsspec imported before
        monkeypatch.delitem(fsspec_registry._registry, protocol, raising=False)
    scheme = spec.split("::")[-1].split(":")[0]
    with pytest.raises(ImportError) as info:
        gs.all_gather_object(1, store=spec)
    assert (
        str(info.value)
        == f"store scheme {scheme!r} needs {package}, which is not installed: {hint}"
    )
    assert info.value.name == package
