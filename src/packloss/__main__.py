"""``python -m packloss``: the ``packloss`` command (see :mod:`packloss.tools.cli`)."""

from packloss.tools.cli import main

raise SystemExit(main())
