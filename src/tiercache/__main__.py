"""``python -m tiercache``: the command line (see `tiercache.cli`)."""

import sys

from tiercache.cli import main

sys.exit(main())
