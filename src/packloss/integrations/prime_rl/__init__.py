"""prime-rl on packloss: its current trainer loss API (:mod:`.current`, re-exported here) and its
#2951-era loss module (:mod:`.legacy`, also ``packloss.compat.prime_rl``), over one list reader and
one ``compute_loss`` (:mod:`.loss`), and its fused output heads (:mod:`.head`).
``docs/integrations/prime_rl.md``."""

from packloss.integrations.prime_rl.current import *  # noqa: F403
from packloss.integrations.prime_rl.current import __all__ as _current
from packloss.integrations.prime_rl.head import FusedOutputLinear, GemmaFusedOutputLinear, PrimeLmOutput

__all__ = [*_current, "FusedOutputLinear", "GemmaFusedOutputLinear", "PrimeLmOutput"]
