"""Guards on the repository's shape: imports run one way with no cycle and no function-level import in
``core``, the trust-region registry does not depend on import order, every module and name the docs
cite exists, the version is written once, files and module docstrings stay short, tests mirror src."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import packloss
from conftest import ROOT

SRC = ROOT / "src" / "packloss"
RANKS = {"core": 0, "vocab": 1, "integrations": 2, "testing": 3, "compat": 3, "tools": 4}
"""Who may import whom: a package imports only packages of a lower rank, or itself."""


def _modules() -> dict[str, Path]:
    """Every module of ``packloss`` by dotted name."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> list[tuple[str, ast.AST, bool]]:
    """``(imported module, node, at module level)`` for every packloss import of ``path``."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("packloss"):
            found.append((node.module, node, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(a.name, node, id(node) in top) for a in node.names if a.name.startswith("packloss")]
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANKS) else ""


def test_imports_run_one_way():
    wrong = []
    for name, path in _modules().items():
        own = _package(name)
        for target, node, _ in _imports(path):
            other = _package(target)
            if own and other and other != own and RANKS[other] >= RANKS[own]:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} ({own}) imports {target} ({other})")
    assert not wrong, "\n".join(wrong)


def test_core_has_no_cycle_and_no_function_level_import():
    modules = {k: v for k, v in _modules().items() if k.startswith("packloss.core")}
    graph: dict[str, set[str]] = {}
    late = []
    for name, path in modules.items():
        text = path.read_text()
        assert "TYPE_CHECKING" not in text, f"{path.relative_to(ROOT)}: TYPE_CHECKING hides an import cycle"
        graph[name] = set()
        for target, node, top in _imports(path):
            if not top:
                late.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target} inside a function")
            # `from packloss.core import checks` imports the module packloss.core.checks
            names = [a.name for a in getattr(node, "names", [])]
            for candidate in [target, *(f"{target}.{n}" for n in names)]:
                if candidate in modules and candidate != name:
                    graph[name].add(candidate)
    assert not late, "\n".join(late)
    for path in modules.values():
        for target, _, _ in _imports(path):
            assert target.startswith("packloss.core"), f"{path.relative_to(ROOT)} imports {target}"
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " → ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_core_imports_only_torch_and_the_standard_library():
    allowed = {"torch", "packloss", *sys.stdlib_module_names}
    for name, path in _modules().items():
        if not name.startswith("packloss.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = []
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            for root in roots:
                assert root in allowed, f"{path.relative_to(ROOT)} imports {root}"


_REGISTRY = (
    "import json, packloss; print(json.dumps({k: v.__module__ + '.' + v.__qualname__ "
    "for k, v in sorted(packloss.TRUST_REGIONS.items())}))"
)


@pytest.mark.parametrize(
    "first",
    [
        [],
        ["packloss.integrations.trl"],
        ["packloss.integrations.openrlhf", "packloss.integrations.trl"],
        ["packloss.integrations.prime_rl", "packloss.compat.prime_rl", "packloss.integrations.verl"],
        ["packloss.integrations.verl.plugin", "packloss.integrations.openrlhf"],
        ["packloss.core.trust_regions.selection", "packloss.tools.objectives_doc"],
    ],
)
def test_trust_regions_are_the_same_whatever_is_imported_first(first):
    """Every region is defined and registered in core, so the registry is complete after any import."""
    code = "".join(f"import {m}; " for m in first) + _REGISTRY
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    registry = json.loads(out)
    assert registry == {k: v.__module__ + "." + v.__qualname__ for k, v in sorted(packloss.TRUST_REGIONS.items())}
    assert all(v.startswith("packloss.core.trust_regions.") for v in registry.values())


_DOTTED = re.compile(r"\bpackloss(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_PATHS = re.compile(r"(?<![\w/.-])((?:src|tests|docs|scripts)/[\w./-]+\.(?:py|md|sh|png))")


EXTERNAL = {"tests/unit/train/rl/test_loss.py", "tests/utils/test_linear_cross_entropy.py"}
"""Paths the docs cite in other repositories (prime-rl's loss tests, verl's fused-kernel test)."""


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_and_name_the_docs_cite_exists():
    """``packloss.x.y`` names and repository paths in the README and docs/ resolve (the CHANGELOG is
    history: its ``before`` column names what was removed, so only its paths are checked)."""
    missing = []
    for doc in _docs():
        text = doc.read_text()
        if doc.name != "CHANGELOG.md":
            missing += [f"{doc.name}: {d}" for d in sorted(set(_DOTTED.findall(text))) if not _resolve(d.rstrip("."))]
        paths = set(_PATHS.findall(text)) - EXTERNAL
        missing += [f"{doc.name}: {p}" for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


def test_the_version_is_written_once():
    pyproject = (ROOT / "pyproject.toml").read_text()
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert 'dynamic = ["version"]' in project and not re.search(r"^version\s*=", project, flags=re.M)
    assert 'version = { attr = "packloss.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", packloss.__version__)
    assert f"## {packloss.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_source_files_and_module_docstrings_are_short():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines" for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500
    ]
    assert not long, long
    wordy = []
    for path in SRC.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc is not None and len(doc.splitlines()) > 20:
            wordy.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not wordy, wordy


def test_tests_mirror_the_source():
    """``src/packloss/a/b.py`` is tested by ``tests/a/test_b.py``."""
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(SRC)
        test = ROOT / "tests" / rel.parent / f"test_{rel.stem.lstrip('_')}.py"
        if not test.exists():
            missing.append(f"{rel} → {test.relative_to(ROOT)}")
    assert not missing, "\n".join(missing)
