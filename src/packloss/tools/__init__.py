"""The ``packloss`` command-line tools (``bench``, ``check``, ``demo``), kept apart from the library."""
