"""The ``gatherstore`` command: demo, bench, check, gc, results."""
