"""``python -m packloss``: the ``packloss`` command (see :mod:`packloss.cli`)."""

from packloss.cli import main

raise SystemExit(main())
