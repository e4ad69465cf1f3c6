"""``python -m gatherstore``: the ``gatherstore`` command."""

import sys

from gatherstore.cli.main import main

sys.exit(main())
