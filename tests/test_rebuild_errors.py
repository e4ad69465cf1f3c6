"""A part that pickles but cannot be rebuilt on the reader fails as a GatherError naming
its rank, with the unpickler's error as the cause, on every route."""

from __future__ import annotations

from typing import Any

import pytest

import gatherstore as gs


def _refuse(rank: int) -> Any:
    raise ValueError(f"object of rank {rank} cannot be rebuilt")


class Fussy:
    """Pickles fine; unpickling it raises the rebuild function's ValueError."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse, (self.rank,))


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "gather_error": isinstance(exc, gs.GatherError),
            "message": str(exc),
            "cause": type(cause).__name__ if cause else None,
            "rank": getattr(exc, "rank", None),
        }
    return {"error": None}


def _every_route(tmp: str, redis_url: str) -> dict[str, Any]:
    rank = gs.get_rank()
    big = bytes(300 << 10)  # past the auto threshold
    fussy = [Fussy(rank), big] if rank == 1 else [rank, big]
    out: dict[str, Any] = {}
    for route in ("collective", "stream", f"tmpdir://{tmp}", redis_url):
        name = route.split(":")[0]
        limits = {"store": route, "timeout": 60}
        out[f"gather {name}"] = _outcome(lambda k=limits: gs.gather_object(fussy, **k))
        out[f"all {name}"] = _outcome(lambda k=limits: gs.all_gather_object(fussy, **k))
        one = Fussy(1) if rank == 1 else None
        out[f"bcast {name}"] = _outcome(lambda k=limits, o=one: gs.broadcast_object(o, 1, **k))
        out[f"after {name}"] = gs.all_gather_object(rank, **limits)
    return out


@pytest.mark.timeout(240)
def test_a_part_that_cannot_be_rebuilt_names_its_rank_on_every_route(
    tmp_path: Any, gatherstore_redis_url: str
) -> None:
    results = gs.launch(
        _every_route,
        nproc_per_node=3,
        backend="gloo",
        args=(str(tmp_path), gatherstore_redis_url),
        timeout=60,
    )
    for rank, out in enumerate(results):
        for label, seen in out.items():
            if label.startswith("after"):
                assert seen == [0, 1, 2], (rank, label)
                continue
            call = label.split()[0]
            reader = rank == 0 if call == "gather" else rank != 1
            if reader:  # it met the part itself: the unpickler's error is the cause
                assert seen["error"] == "GatherError", (rank, label, seen)
                assert seen["cause"] == "ValueError", (rank, label, seen)
                assert "part of rank 1" in seen["message"], (rank, label, seen)
                assert "cannot be rebuilt" in seen["message"], (rank, label, seen)
            else:  # rank 1 never rebuilds its own part; it may learn of the readers' failure
                assert seen["error"] is None or seen["gather_error"], (rank, label, seen)
