"""What "the same" means when a compat module is compared with the real library."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch


def same(a: Any, b: Any, where: str = "value") -> list[str]:
    """Differences between ``a`` (original) and ``b`` (compat): types, values, key order,
    tensors' dtype, shape, device and values."""
    if type(a) is not type(b):
        return [f"{where}: type {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            return [
                f"{where}: {a.dtype}/{tuple(a.shape)}/{a.device} != {b.dtype}/{b.shape}/{b.device}"
            ]
        return [] if torch.equal(a, b) else [f"{where}: {a} != {b}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in same(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in same(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value, or ("raised", exception class, message) when it raises."""
    try:
        return fn()
    except Exception as exc:
        return ("raised", type(exc), str(exc))


def same_outcome(a: Any, b: Any, where: str, messages: bool = False) -> list[str]:
    """As :func:`same`, where a compat exception may subclass the original's (and, with
    ``messages``, must say the same words)."""
    if isinstance(a, tuple) and a[:1] == ("raised",):
        if isinstance(b, tuple) and b[:1] == ("raised",) and issubclass(b[1], a[1]):
            if messages and a[2] != b[2]:
                return [f"{where}: message {a[2]!r} != {b[2]!r}"]
            return []
        return [f"{where}: original raised {a[1].__name__}: {a[2]}, compat gave {b!r}"]
    return same(a, b, where)


def signature_differences(original: Any, compat: Any, name: str) -> list[str]:
    """Parameters' names, kinds, order and defaults; compat may add defaulted ones at the end."""
    ours = list(inspect.signature(compat).parameters.values())
    theirs = list(inspect.signature(original).parameters.values())
    problems = []
    for i, p in enumerate(theirs):
        q = ours[i] if i < len(ours) else None
        if q is None or (p.name, p.kind, p.default) != (q.name, q.kind, q.default):
            problems.append(f"{name}: parameter {i} {p} != {q}")
    for q in ours[len(theirs) :]:
        if q.default is inspect.Parameter.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            problems.append(f"{name}: extra parameter {q} has no default")
    return problems


def failure(fn: Callable[[], Any], message: str) -> dict[str, Any]:
    """How ``fn()`` failed, in a form a rank can send back: the exception's class name, the
    rank a RemoteRankError names, and whether the text carries ``message``."""
    try:
        fn()
    except Exception as exc:
        return {
            "raised": type(exc).__name__,
            "names": getattr(exc, "rank", None),
            "says why": message in str(exc),
        }
    return {"raised": None}


def recorder() -> tuple[list[tuple[str, Any]], Callable[[str, Callable[[], Any]], None]]:
    """A list of (label, outcome) and the function that runs a call and records it there."""
    out: list[tuple[str, Any]] = []

    def record(label: str, fn: Callable[[], Any]) -> None:
        out.append((label, outcome(fn)))

    return out, record


def differences(
    original: list[tuple[str, Any]],
    compat: list[tuple[str, Any]],
    messages: Callable[[str], bool] = lambda label: False,
) -> list[str]:
    """Every difference between two recordings of the same script; ``messages(label)``: whether
    that call's exception must say the original's words."""
    return [
        p
        for (label, a), (_, b) in zip(original, compat, strict=True)
        for p in same_outcome(a, b, label, messages(label))
    ]


def module_signature_differences(original: Any, compat: Any) -> list[str]:
    """:func:`signature_differences` for every public function ``original`` defines, each of
    which ``compat`` must export."""
    names = [
        name
        for name, value in vars(original).items()
        if callable(value)
        and getattr(value, "__module__", None) == original.__name__
        and not name.startswith("_")
    ]
    problems = [f"{name}: not exported" for name in names if name not in compat.__all__]
    return problems + [
        p
        for name in names
        for p in signature_differences(getattr(original, name), getattr(compat, name), name)
    ]


def reused_buffer(gather: Callable[[Any], Any], rank: int, steps: int = 3) -> list[Any]:
    """What a caller keeps of ``steps`` gathers of views of one buffer it refills every
    step, as a model's outputs often are (a Trainer keeps every step's outputs)."""
    buffer = torch.zeros(4)
    kept = []
    for step in range(steps):
        buffer.fill_(10 * step + rank)
        kept.append(gather({"step": step, "scores": buffer[:2]}))
    return kept


def kept_steps(kept: list[Any]) -> list[Any]:
    """What :func:`reused_buffer` kept, as plain values: (step, scores) per rank of each
    step (None where a step returned None)."""
    return [None if s is None else [(o["step"], o["scores"].tolist()) for o in s] for s in kept]


def steps_of(ranks: list[int], steps: int = 3) -> list[Any]:
    """:func:`kept_steps` of a gather of ``ranks``' buffers, each kept at its step's values."""
    return [[(s, [10 * s + r] * 2) for r in ranks] for s in range(steps)]


class Unsendable:
    """An object that can be copied (libraries copy states before they sync) but not
    pickled: a gather fails on the rank that holds one."""

    def __deepcopy__(self, memo: Any) -> Unsendable:
        return self

    def __reduce__(self) -> Any:
        raise TypeError("this item cannot be sent")
