"""docs/objectives.md is what the code generates, and every "tested by" claim in it points at a test
file that exercises that trust region."""

from __future__ import annotations

import inspect

import pytest

import packloss
import packloss.vocab
from conftest import ROOT
from packloss.core.bin import Objective
from packloss.core.pg import PolicyGradient
from packloss.core.trust_regions import TRUST_REGIONS
from packloss.tools import objectives_doc


def test_docs_are_generated_from_the_code():
    assert (ROOT / "docs" / "objectives.md").read_text() == objectives_doc.render(), (
        "docs/objectives.md is stale: run `python -m packloss.tools.objectives_doc --write`"
    )


def test_every_registered_region_names_its_tests():
    missing = sorted(set(TRUST_REGIONS) - set(objectives_doc.TESTED_BY))
    assert not missing, f"trust regions without tests in TESTED_BY: {missing}"


def _uses(path: str, cls: type, name: str) -> bool:
    """Whether the test file names the region, or tests an adapter whose package uses it."""
    text = (ROOT / path).read_text()
    if cls.__name__ in text or f'"{name}"' in text:
        return True
    if path.startswith("tests/integrations/"):
        package = ROOT / "src" / "packloss" / "integrations" / path.split("/")[2]
        return any(cls.__name__ in f.read_text() for f in package.glob("*.py"))
    return False


@pytest.mark.parametrize("name", sorted(TRUST_REGIONS))
def test_tested_by_claims_hold(name):
    """Each cited test file exists and exercises the region (by its class or registered name, or through
    the adapter it tests); the region's family file compares it with a reference."""
    cls = TRUST_REGIONS[name]
    for path in objectives_doc.tested_by(name):
        assert _uses(path, cls, name), f"{name}: {path} does not exercise {cls.__name__}"
    family = objectives_doc.family_test(cls)
    assert _uses(family, cls, name) and "reference" in (ROOT / family).read_text(), name


def test_every_public_objective_is_listed_and_its_test_file_exercises_it():
    public = {v for m in (packloss, packloss.vocab) for v in vars(m).values() if inspect.isclass(v)}
    objectives = {c for c in public if issubclass(c, Objective)} - {Objective, PolicyGradient}
    assert objectives == set(objectives_doc.OBJECTIVES)
    for cls in objectives_doc.OBJECTIVES:
        path = ROOT / objectives_doc.objective_test(cls)
        assert cls.__name__ in path.read_text(), f"{path} does not exercise {cls.__name__}"
