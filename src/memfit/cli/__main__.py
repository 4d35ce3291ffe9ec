"""``python -m memfit.cli``, as ``python -m memfit`` and the ``memfit`` command."""

import sys

from memfit.cli import main

sys.exit(main())
