"""``python -m coordinator``: the ``inbox-coordinator`` command."""

import sys

from coordinator.ops.cli import main

sys.exit(main())
