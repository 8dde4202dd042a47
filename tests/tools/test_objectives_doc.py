"""docs/objectives.md is what the code generates, and every "tested by" claim in it points at a test
that exercises that trust region."""

from __future__ import annotations

from pathlib import Path

from packloss.core.trust_regions import TRUST_REGIONS
from packloss.tools import objectives_doc
from tests.core.test_trust_regions import OBJECTIVES

ROOT = Path(__file__).resolve().parents[2]


def test_docs_are_generated_from_the_code():
    assert (ROOT / "docs" / "objectives.md").read_text() == objectives_doc.render(), (
        "docs/objectives.md is stale: run `python -m packloss.tools.objectives_doc --write`"
    )


def test_every_registered_region_names_its_tests():
    missing = sorted(set(TRUST_REGIONS) - set(objectives_doc.TESTED_BY))
    assert not missing, f"trust regions without tests in TESTED_BY: {missing}"


def _source(name: str) -> str:
    """The source of integration ``name``: its module, or every module of its package."""
    base = ROOT / "src" / "packloss" / "integrations"
    files = [base / f"{name}.py"] if (base / f"{name}.py").exists() else sorted((base / name).glob("*.py"))
    return "\n".join(f.read_text() for f in files)


def test_tested_by_claims_hold():
    paper_tested = {objective.trust_region.name for objective, _ in OBJECTIVES.values()}
    sources = {
        "test_trust_regions.py": None,
        "test_selection.py": (ROOT / "tests" / "core" / "test_selection.py").read_text(),
        "test_trl.py": _source("trl"),
        "test_verl.py": _source("verl"),
        "test_prime_rl.py": None,
    }
    for name, claims in objectives_doc.TESTED_BY.items():
        cls = TRUST_REGIONS[name]
        for claim in claims:
            if "test_trust_regions.py" in claim:
                assert name in paper_tested, f"{name}: no OBJECTIVES entry in tests/core/test_trust_regions.py"
            elif "test_prime_rl.py" in claim:
                assert name in ("dppo", "ipo", "one_sided"), name
            else:
                key = next(k for k in sources if k in claim)
                used = cls.__name__ in sources[key] or f'"{name}"' in sources[key]  # the class or its name
                assert used, f"{name}: {cls.__name__} not used where {key} tests it"
