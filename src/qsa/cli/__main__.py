"""``python -m qsa.cli``: the ``qsa`` command."""

import sys

from .commands import main

sys.exit(main())
