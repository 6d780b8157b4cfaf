"""``python -m kq``: the ``kq`` command line without the installed script."""

import sys

from kq.cli import main

sys.exit(main())
