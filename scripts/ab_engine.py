"""Interleaved A/B timing of the packed-bin engine against an older version of packloss.

    .venv/bin/python scripts/ab_engine.py 93d8430          # 0.1's last commit; 32,768-token bins

The old version is exported from git into a temporary folder and imported as ``packloss_old`` (its
imports rewritten), so both run in one process on the same bins with the same integer denominators,
one call of each per round: the ratio is immune to the machine's load drifting between two separate
``packloss bench`` runs. Only for versions whose API is 0.1's (``PackedBatch``, ``compute_loss(batch,
**scales)``); it checks the two losses agree before timing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def export_old(ref: str, root: Path) -> None:
    """``git archive`` of ``ref``'s ``src/packloss`` into ``root/packloss_old`` with imports renamed."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "src/packloss"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    (root / "src" / "packloss").rename(root / "packloss_old")
    for path in (root / "packloss_old").rglob("*.py"):
        text = re.sub(r"\bpackloss(?=[. ])", "packloss_old", path.read_text())
        path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="git ref of the old version (0.1 API)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        export_old(args.ref, Path(tmp))
        sys.path.insert(0, tmp)
        import packloss_old
        import packloss_old.testing as old_testing

        from packloss import compute_loss, count_denominators
        from packloss.testing import make_archetype, random_seq_lens

        print("| archetype | seqs/bin | old ms | new ms | new ÷ old |\n|---|---:|---:|---:|---:|")
        for arch in ("hot", "opd", "echo", "sdft"):
            for num_seqs in (1, 256):
                lens = random_seq_lens(args.tokens, num_seqs, torch.Generator().manual_seed(10_000 + num_seqs))
                streams = make_archetype(arch, lens, seed=num_seqs)
                plan, outputs = streams.plan(), streams.outputs()
                den = count_denominators([plan])
                old_bin = old_testing.make_archetype(arch, lens, seed=num_seqs)
                scales = {k: torch.tensor(float(v)) for k, v in streams.integer_scales().items()}
                new_loss = compute_loss(plan, outputs, den).loss
                old_loss = packloss_old.compute_loss(old_bin, **scales).loss
                assert torch.allclose(new_loss, old_loss, rtol=1e-5), (arch, float(new_loss), float(old_loss))
                steps = {
                    "old": lambda b=old_bin, s=scales: packloss_old.compute_loss(b, **s).loss.backward(),
                    "new": lambda p=plan, o=outputs, d=den: compute_loss(p, o, d).loss.backward(),
                }
                times: dict[str, list[float]] = {"old": [], "new": []}
                for step in steps.values():
                    for _ in range(5):
                        step()
                for _ in range(args.repeat):
                    for name, step in steps.items():
                        t0 = time.perf_counter()
                        step()
                        times[name].append(time.perf_counter() - t0)
                old_ms, new_ms = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
                print(f"| {arch} | {num_seqs} | {old_ms:.2f} | {new_ms:.2f} | {new_ms / old_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
