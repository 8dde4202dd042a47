#!/usr/bin/env bash
# Run prime-rl's own tests/unit/train/rl/test_loss.py against packloss's prime-rl modules.
#
# Manual, not CI: prime-rl is not pip-installable here and packloss vendors none of its code, so
# this script takes prime-rl's test file from a local copy (a checkout, a bare git mirror, or the
# file itself), copies it into a temporary directory and rewrites it there:
#
#   * `from prime_rl.configs.trainer import ...` and `from prime_rl.trainer.rl.loss import ...` import
#     from packloss.integrations.prime_rl (--target integrations, the default: the current API) or
#     packloss.compat.prime_rl (--target compat: the #2951-era API). A name the target does not
#     define becomes a placeholder: a test that calls or reads it is skipped with the name as the
#     reason (a class called at import time, e.g. in a parametrize list, is deferred to the test).
#   * without CUDA, "cuda" becomes "cpu" and Tensor.cuda() returns the tensor (the tests are marked
#     `gpu` and written for a GPU; the losses themselves are device-agnostic).
#
# Then it runs pytest there with -rA, so every test's outcome and reason is listed. It fetches nothing.
#
# Usage:
#   scripts/run_prime_rl_tests.sh [--target integrations|compat] [--ref GIT_REF] SOURCE
#     SOURCE: a prime-rl checkout, a bare git dir (read at GIT_REF, default HEAD), or a test_loss.py
#   PYTHON=/path/to/python overrides the interpreter (default: this repository's .venv, else python3).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-2}"; }

target=integrations
ref=HEAD
source_path=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --target) target="${2:?--target needs integrations or compat}"; shift 2 ;;
    --ref) ref="${2:?--ref needs a git ref}"; shift 2 ;;
    -h|--help) usage 0 ;;
    -*) echo "unknown option: $1" >&2; usage ;;
    *) [[ -z "$source_path" ]] || { echo "one SOURCE only" >&2; usage; }; source_path="$1"; shift ;;
  esac
done
[[ -n "$source_path" ]] || usage
case "$target" in
  integrations|compat) ;;
  *) echo "--target must be integrations or compat, got $target" >&2; exit 2 ;;
esac

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then python="$repo_root/.venv/bin/python"; else python=python3; fi
fi

rel=tests/unit/train/rl/test_loss.py
work="$(mktemp -d -t prime_rl_tests.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tests/unit/train/rl"
for d in tests tests/unit tests/unit/train tests/unit/train/rl; do : > "$work/$d/__init__.py"; done

if [[ -f "$source_path" ]]; then
  cp "$source_path" "$work/$rel"
  origin="file $source_path"
elif [[ -f "$source_path/$rel" ]]; then
  cp "$source_path/$rel" "$work/$rel"
  origin="checkout $source_path ($(git -C "$source_path" log -1 --format='%h %cs %s' 2>/dev/null || echo 'not a git checkout'))"
elif git --git-dir="$source_path" rev-parse --verify --quiet "$ref^{commit}" > /dev/null; then
  git --git-dir="$source_path" show "$ref:$rel" > "$work/$rel"
  origin="git $source_path at $ref ($(git --git-dir="$source_path" log -1 --format='%h %cs %s' "$ref"))"
else
  echo "SOURCE must be a test_loss.py, a prime-rl checkout or a bare git dir with $ref: $source_path" >&2
  exit 2
fi

cat > "$work/conftest.py" << 'EOF'
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: prime-rl's GPU tests (run on the CPU by scripts/run_prime_rl_tests.sh)")


if not torch.cuda.is_available():
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
EOF

PACKLOSS_TARGET="packloss.$target.prime_rl" "$python" - "$work/$rel" << 'EOF'
"""Rewrite prime-rl's imports (ast-located, so multi-line imports are handled) to the packloss target."""
import ast
import os
import sys

import torch

path = sys.argv[1]
target = os.environ["PACKLOSS_TARGET"]
source = open(path).read()
lines = source.splitlines(keepends=True)
replaced = []
for node in ast.parse(source).body:
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prime_rl"):
        names = [(alias.name, alias.asname or alias.name) for alias in node.names]
        replaced.append((node.lineno, node.end_lineno, node.module, names))

header = f'''import os as _os

import pytest as _pytest

import {target} as _target


class _Missing:
    """A name {target} does not define: reading or calling it inside a test skips the test."""

    def __init__(self, name):
        self._name = name

    def _skip(self):
        _pytest.skip(f"{{self._name}} is not defined by {target}")

    def __call__(self, *args, **kwargs):
        if "PYTEST_CURRENT_TEST" in _os.environ:
            self._skip()
        return _Missing(self._name)  # called at import time (e.g. a parametrize list): deferred to the test

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._skip()


def _name(name):
    return getattr(_target, name) if hasattr(_target, name) else _Missing(name)


'''
for start, end, module, names in reversed(replaced):
    body = "".join(f"{alias} = _name({name!r})  # was: from {module} import {name}\n" for name, alias in names)
    lines[start - 1 : end] = [body]
text = "".join(lines)
if not torch.cuda.is_available():
    text = text.replace('"cuda"', '"cpu"').replace("'cuda'", "'cpu'")
# the header goes after any `from __future__` import
# (a __future__ import precedes every prime_rl import, so its line numbers are unchanged)
futures = [n.end_lineno for n in ast.parse(source).body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
text_lines = text.splitlines(keepends=True)
cut = max(futures, default=0)
text = "".join(text_lines[:cut]) + header + "".join(text_lines[cut:])
open(path, "w").write(text)
module = __import__(target, fromlist=["_"])
missing = [name for _, _, _, names in replaced for name, _ in names if not hasattr(module, name)]
print(f"rewrote {len(replaced)} prime_rl import(s) to {target}; names it does not define: {missing or 'none'}")
EOF

echo "prime-rl test file: $origin"
echo "target: packloss.$target.prime_rl; device: $("$python" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')"
cd "$work"
set +e
# (an enclosing pytest exports PYTEST_CURRENT_TEST; the placeholders read it to tell collection from a test)
env -u PYTEST_CURRENT_TEST "$python" -m pytest -q -rA -p no:cacheprovider --rootdir "$work" "$rel"
status=$?
set -e
exit "$status"
