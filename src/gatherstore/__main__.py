"""``python -m gatherstore``: the ``gatherstore`` command."""

import sys

from .cli import main

sys.exit(main())
