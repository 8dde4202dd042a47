"""prime-rl on packloss: its current trainer loss API (:mod:`.current`, re-exported here) and its
#2951-era loss module (:mod:`.legacy`, also ``packloss.compat.prime_rl``), over one list reader and
one ``compute_loss`` (:mod:`.loss`). ``docs/integrations/prime_rl.md``."""

from packloss.integrations.prime_rl.current import *  # noqa: F403
from packloss.integrations.prime_rl.current import __all__  # noqa: F401
