"""``python -m pdserve.cli``: the same as the ``pdserve`` command (what ``pdserve up``
starts its servers with, and what the tests and benchmarks run)."""
from __future__ import annotations

import sys

from pdserve.cli import main

sys.exit(main())
