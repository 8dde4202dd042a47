"""``python -m packloss.tools.demo``: the demo (see :mod:`packloss.tools.demo`)."""

import sys

from packloss.tools.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
