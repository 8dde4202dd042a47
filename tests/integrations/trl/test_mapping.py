"""The TRL mapping table is generated from ``from_trl`` and is the one in ``docs/objectives.md``."""

from __future__ import annotations

from conftest import ROOT
from packloss.integrations.trl import IS_MODES, LOSS_TYPES, mapping_rows, mapping_table
from tests.integrations.trl.harness import IS_CASES


def test_mapping_rows_cover_every_loss_type_and_docs_hold_the_table():
    rows = mapping_rows()
    assert [r.value for r in rows if r.option == "loss_type"] == list(LOSS_TYPES)
    assert all(r.objective.startswith("PolicyGradient(") and r.normalize for r in rows[: len(LOSS_TYPES)])
    assert set(IS_MODES) == {m for m, *_ in filter(None, IS_CASES.values())}
    docs = (ROOT / "docs" / "objectives.md").read_text()
    assert "## TRL 1.16" in docs
    assert mapping_table() in docs, (
        "regenerate the table: python -c 'from packloss.integrations.trl import *; print(mapping_table())'"
    )
