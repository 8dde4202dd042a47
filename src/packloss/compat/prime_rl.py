"""prime-rl's #2951-era trainer loss module under the README's one-import switch: every name of
:mod:`packloss.integrations.prime_rl.legacy`."""

from packloss.integrations.prime_rl.legacy import *  # noqa: F403
from packloss.integrations.prime_rl.legacy import __all__  # noqa: F401
