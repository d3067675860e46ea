"""``python -m cluster.cli``: the ``kvblend`` command line."""

import sys

from cluster.cli.main import main

sys.exit(main())
