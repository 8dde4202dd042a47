"""The verl mapping table is generated from ``from_verl`` and is the one in ``docs/objectives.md``."""

from __future__ import annotations

from conftest import ROOT
from packloss.integrations.verl import mapping_markdown


def test_docs_table_is_generated_from_the_mapping():
    docs = (ROOT / "docs" / "objectives.md").read_text()
    assert "## verl 0.9.1" in docs
    section = docs.split("## verl 0.9.1", 1)[1]
    assert mapping_markdown() in section, "regenerate the table: python -m packloss.integrations.verl"
