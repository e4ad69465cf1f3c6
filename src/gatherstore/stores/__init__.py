"""Byte stores: the Store base class and the registry by URL scheme."""

from .base import KeyExistsError, Store
from .registry import default_store, known_schemes, open_store, register_store, set_default_store

__all__ = [
    "KeyExistsError",
    "Store",
    "default_store",
    "known_schemes",
    "open_store",
    "register_store",
    "set_default_store",
]
