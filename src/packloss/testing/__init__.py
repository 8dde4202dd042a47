"""Testing tools: the per-sequence reference, test data, the op/sync counter and a gloo runner
(and :mod:`packloss.testing.trl`, a bare TRL trainer, imported by its own name)."""

from packloss.testing.archetypes import ARCHETYPES, Streams, make_archetype, random_seq_lens
from packloss.testing.dist import run_gloo
from packloss.testing.ops import SYNC_OPS, OpCounter

__all__ = ["ARCHETYPES", "Streams", "make_archetype", "random_seq_lens", "run_gloo", "OpCounter", "SYNC_OPS"]
