"""``python -m treeops``: the ``treeops`` console command."""

import sys

from .cli import main

sys.exit(main())
