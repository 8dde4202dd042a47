"""verl 0.9.1 on packloss: an actor config as a :class:`~packloss.Recipe` (:func:`from_verl`), verl's
rejection sampling on a packed bin (:func:`rejection_mask`), the mapping table, and packloss's
objectives as verl policy losses (:mod:`.plugin`, loaded by ``import verl`` through the
``verl.plugins`` entry point; this package itself never imports verl). ``docs/integrations/verl.md``."""

from packloss.integrations.verl.config import LOSS_AGG_MODES, LOSS_MODES, VERL_VERSION, from_verl
from packloss.integrations.verl.mapping import mapping_markdown, mapping_rows
from packloss.integrations.verl.rejection import rejection_mask

__all__ = [
    "VERL_VERSION",
    "LOSS_AGG_MODES",
    "LOSS_MODES",
    "from_verl",
    "rejection_mask",
    "mapping_rows",
    "mapping_markdown",
]

if __name__ == "__main__":  # python -m packloss.integrations.verl: the docs table
    print(mapping_markdown(), end="")
