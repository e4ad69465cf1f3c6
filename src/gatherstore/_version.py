"""The installed version, read from the package's metadata (pyproject.toml's version)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["version"]


def version() -> str:
    """gatherstore's version as installed; ``0+unknown`` when it runs from a source tree
    that was never installed (``pip install -e .`` records it)."""
    try:
        return metadata.version("gatherstore")
    except metadata.PackageNotFoundError:
        return "0+unknown"
