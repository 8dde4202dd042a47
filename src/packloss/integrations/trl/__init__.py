"""TRL 1.16 on packloss.

* :func:`from_trl` (:mod:`.config`): a ``GRPOConfig`` → the packloss :class:`~packloss.Recipe` whose loss
  and gradient equal ``GRPOTrainer._compute_loss``'s, with the table :func:`mapping_rows` /
  :func:`mapping_table` and the parts TRL has and packloss's core does not (:class:`CISPOCap`,
  :class:`SequenceLevel`, :class:`VESPO`, :class:`RatioWeightedKL`).
* :class:`PacklossGRPOTrainer` (:mod:`.trainer`, imports ``trl``): TRL's ``GRPOTrainer`` whose loss is
  computed by packloss from TRL's padded batch (``docs/integrations/trl.md``).
"""

from __future__ import annotations

from typing import Any

from packloss.integrations.trl.config import (
    IS_MODES,
    LOSS_TYPES,
    TRL_DEFAULTS,
    VESPO,
    CISPOCap,
    MappingRow,
    RatioWeightedKL,
    SequenceLevel,
    from_trl,
    mapping_rows,
    mapping_table,
)

__all__ = [
    "from_trl",
    "mapping_rows",
    "mapping_table",
    "MappingRow",
    "LOSS_TYPES",
    "IS_MODES",
    "TRL_DEFAULTS",
    "CISPOCap",
    "SequenceLevel",
    "VESPO",
    "RatioWeightedKL",
]  # and PacklossGRPOTrainer, imported on first use (not by ``import *``: it needs trl)

# Documented (and pickled) under the package's name: docs/objectives.md is generated from cls.__module__.
for _cls in (CISPOCap, SequenceLevel, VESPO, RatioWeightedKL, MappingRow):
    _cls.__module__ = __name__
del _cls


def __getattr__(name: str) -> Any:
    # The trainer imports trl (an optional dependency); the mapping does not.
    if name == "PacklossGRPOTrainer":
        from packloss.integrations.trl.trainer import PacklossGRPOTrainer

        return PacklossGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
