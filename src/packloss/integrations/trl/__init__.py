"""TRL 1.16 on packloss: a ``GRPOConfig`` as a :class:`~packloss.Recipe` (:func:`from_trl`), its
mapping table, and :class:`PacklossGRPOTrainer` (:mod:`.trainer`, TRL's ``GRPOTrainer`` with
packloss's loss; imported on first use, it needs ``trl``). ``docs/integrations/trl.md``."""

from __future__ import annotations

from typing import Any

from packloss.integrations.trl.config import IS_MODES, LOSS_TYPES, TRL_DEFAULTS, from_trl
from packloss.integrations.trl.mapping import mapping_rows, mapping_table

__all__ = ["from_trl", "mapping_rows", "mapping_table", "LOSS_TYPES", "IS_MODES", "TRL_DEFAULTS"]


def __getattr__(name: str) -> Any:
    # the trainer imports trl (an optional dependency); the mapping does not
    if name == "PacklossGRPOTrainer":
        from packloss.integrations.trl.trainer import PacklossGRPOTrainer

        return PacklossGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
