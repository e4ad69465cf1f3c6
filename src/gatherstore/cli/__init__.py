"""The ``gatherstore`` command: demo, bench, check, gc, results, describe.

``main`` parses the arguments and imports ``commands`` (and with it torch) only to run
one; ``CommandFailed`` lives here, where the parser and every command see it.
"""

from gatherstore._errors import GatherError

__all__ = ["CommandFailed"]


class CommandFailed(GatherError):
    """A command found a problem; its message is the line to print as it is, without the
    exception's name."""
