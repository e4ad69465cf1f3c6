"""Byte stores: the Store base class and the registry by URL scheme."""

from gatherstore.stores.base import KeyExistsError, Store
from gatherstore.stores.registry import (
    default_store,
    known_schemes,
    open_store,
    register_store,
    set_default_store,
)

__all__ = [
    "KeyExistsError",
    "Store",
    "default_store",
    "known_schemes",
    "open_store",
    "register_store",
    "set_default_store",
]
