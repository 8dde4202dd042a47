"""The GPU run: CUDA checks and benchmarks in one script, figures written into docs/benchmarks.md.

    make bench-gpu            # = python scripts/gpu_check.py --out bench-out-gpu

On a GPU machine that has a CUDA torch but no network (no ``make setup`` there), run it from the source
tree and bring the out folder back; then write the section where the repository lives::

    PYTHONPATH=src python3 scripts/gpu_check.py --out OUT --no-write     # on the GPU machine
    python scripts/gpu_check.py --from OUT                               # here: docs/benchmarks.md

On a machine with CUDA it (1) runs every engine archetype (DPPO), the per-token divergences,
``linear_logprobs``, ``linear_distill`` and the ``VocabDistill`` component forward+backward under
``torch.cuda.set_sync_debug_mode("error")`` — any device→host sync raises — and records whether the
``torch.compile``d engine step is sync-free under the same mode; (2) compares compat's gradients (DPPO)
with the per-sequence reference on the GPU; (3) runs ``packloss bench all --device cuda`` (with
``--quick`` when asked) and (4) replaces the text between the ``<!-- gpu-run -->`` markers of
docs/benchmarks.md with the run's date, GPU, torch version and the suites' tables. Without CUDA it exits
2 at once. Not yet run on a GPU: none was lent to the sessions that wrote it, so its CUDA paths are
unexercised (the section writer was tried on a CPU results.json; the compiled check on CPU with the
``torch.cuda`` calls stubbed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MARK_BEGIN, MARK_END = "<!-- gpu-run -->", "<!-- /gpu-run -->"
CHECKS_FILE = "gpu_checks.json"  # the checks' outcome, beside the suites' results.json in --out


def sync_free_checks(device: str) -> list[str]:
    """Forward+backward of every path with sync debugging set to "error"; the names checked."""
    from packloss import DPPO, Component, Outputs, Plan, VocabDistill, compute_loss, count_denominators
    from packloss.testing import ARCHETYPES, make_archetype, random_seq_lens
    from packloss.vocab import linear_distill, linear_logprobs, reverse_kl

    g = torch.Generator().manual_seed(0)
    prepared = []
    for arch in ARCHETYPES:  # plans and denominators are built before the checked region, as a trainer does
        streams = make_archetype(arch, random_seq_lens(4096, 64, g), seed=1, device=device)
        plan = streams.plan(DPPO)
        prepared.append((f"engine/{arch}", plan, streams.outputs(), count_denominators([plan])))
    n, h, v = 1024, 256, 8192
    hidden = torch.randn(n, h, device=device, requires_grad=True)
    weight = torch.randn(v, h, device=device, requires_grad=True)
    labels = torch.randint(0, v, (n,), device=device)
    mask = torch.rand(n, device=device) < 0.8
    teacher = torch.randn(n, v, device=device)
    kd_plan = Plan([n // 2, n // 2], {"kd": Component(VocabDistill("jsd"), mask=mask)}, teacher_logits=teacher)
    checked = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, plan, outputs, den in prepared:
            compute_loss(plan, outputs, den).loss.backward()
            checked.append(name)
        logits = (hidden.detach() @ weight.detach().T).requires_grad_()
        reverse_kl(logits, teacher, mask).sum().backward()
        checked.append("vocab/reverse_kl")
        lp, ent = linear_logprobs(hidden, weight, labels)
        (lp.sum() + ent.sum()).backward()
        checked.append("vocab/linear_logprobs")
        loss, _ = linear_distill(hidden, weight, teacher, loss_mask=mask)
        loss.backward()
        checked.append("vocab/linear_distill")
        compute_loss(kd_plan, Outputs(hidden=hidden, head_weight=weight)).loss.backward()
        checked.append("engine/VocabDistill (hidden)")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return checked


def compiled_sync_check(device: str) -> str:
    """The ``torch.compile``d engine step (hot archetype, DPPO) under sync debugging "error", after a
    first call that compiles: ``"sync-free"`` or the first line of the error. Recorded, not raised: on CPU
    dynamo guards 0-d float tensors by value (an ``item()`` per call), which should not happen on CUDA."""
    from packloss import DPPO, compute_loss, count_denominators
    from packloss.testing import make_archetype, random_seq_lens

    streams = make_archetype("hot", random_seq_lens(4096, 64, torch.Generator().manual_seed(0)), seed=1, device=device)
    plan = streams.plan(DPPO)
    den, outputs = count_denominators([plan]), streams.outputs()
    step = torch.compile(lambda: compute_loss(plan, outputs, den).loss)
    step().backward()  # compiles, outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step().backward()
        return "sync-free"
    except RuntimeError as exc:
        return f"syncs: {str(exc).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def compat_matches_reference(device: str) -> dict[str, bool]:
    """compat vs the per-sequence reference on the GPU: gradient equality per archetype."""
    from packloss.compat import prime_rl
    from packloss.testing import ARCHETYPES, make_archetype, random_seq_lens, reference

    out = {}
    for arch in ARCHETYPES:
        streams = make_archetype(arch, random_seq_lens(1024, 16, torch.Generator().manual_seed(3)), device=device)
        kwargs = dict(**streams.lists(), **streams.integer_scales())
        config = prime_rl.DefaultLossConfig()
        (g1,) = torch.autograd.grad(prime_rl.compute_loss(**kwargs, rl_loss_fn=prime_rl.setup_rl_loss_fn(config))[0],
                                    streams.trainer_logprobs)  # fmt: skip
        (g2,) = torch.autograd.grad(reference.compute_loss(**kwargs, rl_loss_fn=reference.setup_rl_loss_fn(config))[0],
                                    streams.trainer_logprobs)  # fmt: skip
        out[arch] = bool(torch.equal(g1, g2))
    return out


def _run_date(machine: dict) -> str:
    """The run's own date (``results.json``'s machine info, UTC), else now: ``YYYY-MM-DD HH:MM``."""
    when = machine.get("date")
    moment = datetime.datetime.fromisoformat(when) if when else datetime.datetime.now(datetime.timezone.utc)
    return f"{moment:%Y-%m-%d %H:%M}"


def write_section(results: dict, checked: list[str], compiled: str, compat: dict[str, bool], doc: Path) -> None:
    """Replace the marked GPU section of ``doc`` with this run's figures."""
    from packloss.tools.bench.report import table_rows

    machine = results["machine"]
    lines = [
        MARK_BEGIN,
        f"**Run recorded:** {_run_date(machine)} UTC · "
        f"{machine.get('gpu', machine.get('device'))} · torch {machine.get('torch')} · `scripts/gpu_check.py`"
        f"{' --quick' if results['options']['quick'] else ''}",
        "",
        f'Sync-free under `torch.cuda.set_sync_debug_mode("error")`: {", ".join(checked)}.',
        f"The `torch.compile`d engine step (hot) under the same mode: {compiled}.",
        "compat gradients `torch.equal` to the per-sequence reference on the GPU: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in compat.items())
        + ".",
    ]
    for suite, result in results["suites"].items():
        lines += ["", f"**{suite}**", ""]
        if "error" in result:
            lines.append(f"failed: `{result['error']}`")
            continue
        header, cells = table_rows(suite, result["rows"])
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
    lines.append(MARK_END)
    text = doc.read_text()
    if MARK_BEGIN not in text or MARK_END not in text:
        raise SystemExit(f"gpu_check: {doc} has no {MARK_BEGIN} ... {MARK_END} section to replace")
    head, rest = text.split(MARK_BEGIN, 1)
    doc.write_text(head + "\n".join(lines) + rest.split(MARK_END, 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out-gpu"))
    parser.add_argument("--quick", action="store_true", help="the suites' quick plans (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="do not edit docs/benchmarks.md")
    parser.add_argument(
        "--from", dest="source", type=Path, metavar="DIR",
        help="run nothing: write docs/benchmarks.md's GPU section from DIR's results.json and gpu_checks.json "
        "(the --out folder of a run on another machine)",
    )  # fmt: skip
    args = parser.parse_args()
    doc = ROOT / "docs" / "benchmarks.md"
    if args.source is not None:
        checks = json.loads((args.source / CHECKS_FILE).read_text())
        results = json.loads((args.source / "results.json").read_text())
        write_section(results, checks["checked"], checks["compiled"], checks["compat"], doc)
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: error: CUDA is not available on this machine", file=sys.stderr)
        return 2
    checked = sync_free_checks("cuda")
    print("sync-free:", ", ".join(checked), flush=True)
    compiled = compiled_sync_check("cuda")
    print("compiled engine step:", compiled, flush=True)
    compat = compat_matches_reference("cuda")
    print("compat == reference:", compat, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    checks = {"checked": checked, "compiled": compiled, "compat": compat}
    (args.out / CHECKS_FILE).write_text(json.dumps(checks, indent=2) + "\n")
    bench = [sys.executable, "-m", "packloss", "bench", "all", "--device", "cuda", "--out", str(args.out)]
    code = subprocess.run(bench + (["--quick"] if args.quick else []), cwd=ROOT).returncode
    results = json.loads((args.out / "results.json").read_text())
    if not args.no_write:
        write_section(results, checked, compiled, compat, doc)
    return code or (0 if all(compat.values()) else 1)


if __name__ == "__main__":
    raise SystemExit(main())
