"""``python -m gatherstore``: the ``gatherstore`` command."""

import sys

from ._cli import main

sys.exit(main())
