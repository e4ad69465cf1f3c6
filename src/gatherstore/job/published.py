"""Job areas published on the launcher's rendezvous store, so that it sweeps a stopped job.

When ``gs.launch`` (or any launcher whose store outlives the ranks) hosts the
rendezvous store, rank 0 publishes each job area it creates there; the
launcher's process removes what is still published once its children have
stopped.  The rendezvous store is readable by every process that can reach
its port, so what goes there is plain JSON without secrets: the store's URL
without its password or secret query parameters, its JSON-safe options
without credentials, and the area's locator.  Never a pickle: the launcher
would otherwise unpickle whatever a process on the network wrote there.  The
launcher reopens the store from that, preferring a store it holds itself with
the same public description (its ``GATHERSTORE_STORE`` or default store, which
carry the credentials), else from its own environment (e.g. AWS variables).
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from typing import Any

import torch.distributed as dist

from gatherstore.job import control
from gatherstore.stores._secrets import is_secret
from gatherstore.stores.base import Store
from gatherstore.stores.registry import default_store, open_store

__all__ = ["launcher_store", "public_spec", "publish", "sweep", "unpublish"]

_PUBLISHED = "gatherstore-areas"  # counter key on the launcher's store; areas at "<key>/<n>"


def _public_url(url: str) -> str:
    """``url`` without the password in its userinfo and without secret query parameters."""
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user = parts.username or ""
            netloc = (f"{user}@" if user else "") + netloc.rsplit("@", 1)[1]
    except ValueError:  # unparsable: keep nothing that might be a secret
        return url.split("://", 1)[0] + "://"
    query = [
        (name, value)
        for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if not is_secret(name)
    ]
    return urllib.parse.urlunsplit(
        parts._replace(netloc=netloc, query=urllib.parse.urlencode(query))
    )


def _public_options(options: Any) -> Any:
    """The JSON-safe part of ``options`` without credentials (recursively)."""
    if isinstance(options, dict):
        return {
            str(name): _public_options(value)
            for name, value in options.items()
            if isinstance(name, str) and not is_secret(name) and _json_safe(value)
        }
    if isinstance(options, (list, tuple)):
        return [_public_options(value) for value in options if _json_safe(value)]
    return options


def _json_safe(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) for k in value)
    return isinstance(value, (list, tuple))


def public_spec(store: Store) -> dict[str, Any]:
    """What reopens ``store`` without any of its secrets: URL and options."""
    return {"url": _public_url(store.url), "options": _public_options(store._options())}


def launcher_store() -> Any | None:
    """The rendezvous store itself (no prefix) when a launcher hosts it, else None."""
    if not control.launcher_hosts_store():
        return None
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def publish(store: Store, locator: str) -> str:
    """Publish ``store``'s job area at ``locator`` on the launcher's rendezvous store;
    returns the key ("" when no launcher hosts the store, or publishing failed)."""
    with contextlib.suppress(Exception):  # best effort: the signal handlers sweep too
        launcher = launcher_store()
        if launcher is not None:
            key = f"{_PUBLISHED}/{launcher.add(_PUBLISHED, 1)}"
            launcher.set(key, json.dumps({**public_spec(store), "locator": locator}))
            return key
    return ""


def unpublish(key: str) -> None:
    """Forget a published area (its job removed it itself)."""
    launcher = launcher_store()
    if key and launcher is not None:
        launcher.delete_key(key)


def _reopen(spec: dict[str, Any]) -> Store:
    """The store ``spec`` describes: one this process holds with the same public spec (it
    has the credentials), else one opened from the spec and this process's environment."""
    wanted = {"url": spec["url"], "options": spec["options"]}
    with contextlib.suppress(Exception):
        held = open_store(default_store())
        if public_spec(held) == wanted:
            return held
    return open_store(spec["url"], **spec["options"])


def sweep(launcher: Any) -> None:
    """In the launcher, after its children stopped: end every area still published."""
    for n in range(1, int(launcher.add(_PUBLISHED, 0)) + 1):
        key = f"{_PUBLISHED}/{n}"
        with contextlib.suppress(Exception):  # best effort, like the ranks' own clean-up
            if launcher.check([key]):
                spec = json.loads(launcher.get(key))
                _reopen(spec).end_job(spec["locator"])
                launcher.delete_key(key)
