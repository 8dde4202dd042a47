"""The ``trainers`` suite: one optimizer step of TRL 1.16's own ``GRPOTrainer`` beside
``PacklossGRPOTrainer`` (packloss's loss and fused head) on a Qwen2-architecture model built here with
Qwen2's vocabulary (V = 151,936) and a small hidden size, so that it runs on CPU.

Both trainers load the same saved weights (tied embeddings) and take the same micro-batch (left-padded
prompts, ragged completions, TRL's defaults: ``dapo``, temperature 1, no reference model). Each part
runs in a fresh process per trainer:

* ``logprob``: ``_get_per_token_logps_and_entropies`` (the policy's log-probs and entropy, the model's
  backbone included), forward and backward of ``Σ mask · logp``; the backbone alone is timed beside it;
* ``step``: ``compute_loss``, backward and a step of the trainer's own optimizer (``optim="sgd"``).

Peak memory: the first call's, CPU peak RSS over the baseline with the model and the batch in memory;
time: the median of the calls after it. The first call's log-probs, entropy, loss and parameter update
are compared between the trainers (:class:`~packloss.tools.bench._measure.ValuesDisagree` beyond
``RTOL``). ``docs/benchmarks.md``.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from packloss.testing.trl import completion_batch
from packloss.tools.bench._measure import (
    check,
    import_peer,
    peak_bytes,
    release_freed_memory,
    reset_peak,
    run_fresh,
    time_ms,
)

__all__ = ["Shape", "SHAPES", "VARIANTS", "PARTS", "RTOL", "save_model", "measure", "run"]

VARIANTS = ("trl", "packloss")
PARTS = ("logprob", "step")
RTOL = {"logprobs": 1e-5, "entropy": 1e-5, "loss": 1e-5, "update": 1e-4}
"""Relative tolerances (of the largest magnitude) between the trainers' first-call values, float32."""


@dataclass(frozen=True)
class Shape:
    """The model (``vocab``, ``hidden``, ``layers``) and the micro-batch: ``rows`` completions of at most
    ``completion`` tokens after prompts of at most ``prompt`` tokens; ``repeat`` timed calls."""

    vocab: int
    hidden: int
    layers: int
    rows: int
    prompt: int
    completion: int
    repeat: int

    def lengths(self) -> tuple[list[int], list[int]]:
        """Ragged prompt and completion lengths: from the full width down to about a half of it."""
        prompts = [self.prompt - (i % 4) * self.prompt // 8 for i in range(self.rows)]
        completions = [self.completion - i * self.completion // (2 * self.rows) for i in range(self.rows)]
        return prompts, completions

    def describe(self) -> str:
        return (f"Qwen2 V={self.vocab} H={self.hidden} layers={self.layers}; "
                f"B={self.rows} prompt≤{self.prompt} completion≤{self.completion}")  # fmt: skip


SHAPES = {
    False: Shape(vocab=151_936, hidden=64, layers=2, rows=8, prompt=128, completion=384, repeat=3),
    True: Shape(vocab=2048, hidden=16, layers=1, rows=4, prompt=6, completion=10, repeat=1),
}
"""By ``quick``: Qwen2's real vocabulary, or a tiny one for the suite's test."""


def _peers() -> tuple[SimpleNamespace | None, str | None]:
    """The libraries the suite drives, or why one cannot be imported."""
    found = {}
    for name, module in (("trl", "trl"), ("transformers", "transformers"), ("datasets", "datasets"),
                         ("tokenizers", "tokenizers"), ("packloss", "packloss.integrations.trl.trainer")):  # fmt: skip
        found[name], why = import_peer(module)
        if why is not None:
            return None, why
    return SimpleNamespace(**found), None


def _require_peers() -> SimpleNamespace:
    peers, why = _peers()
    if peers is None:
        raise RuntimeError(why)
    return peers


def _model_config(peers: SimpleNamespace, shape: Shape) -> Any:
    return peers.transformers.Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=shape.prompt + shape.completion, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip


def save_model(shape: Shape, path: Path) -> None:
    """A seeded Qwen2 model of ``shape`` saved at ``path`` (both trainers load it)."""
    peers = _require_peers()
    torch.manual_seed(0)
    peers.transformers.Qwen2ForCausalLM(_model_config(peers, shape)).save_pretrained(path)


def _trainer(peers: SimpleNamespace, variant: str, shape: Shape, model: str, workdir: str) -> Any:
    words = peers.tokenizers.Tokenizer(peers.tokenizers.models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    tokenizer = peers.transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>",
                                                           eos_token="<eos>")  # fmt: skip
    args = peers.trl.GRPOConfig(
        output_dir=workdir, use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=shape.rows, num_generations=shape.rows, max_completion_length=shape.completion,
        optim="sgd", learning_rate=1e-2, lr_scheduler_type="constant",
    )  # fmt: skip
    cls = peers.trl.GRPOTrainer if variant == "trl" else peers.packloss.PacklossGRPOTrainer
    dataset = peers.datasets.Dataset.from_dict({"prompt": ["<eos>"] * shape.rows})
    trainer = cls(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by Trainer's train loop
    return trainer


def _inputs(shape: Shape) -> dict[str, Tensor]:
    prompts, completions = shape.lengths()
    return completion_batch(shape.vocab, prompts, completions, seed=1)


def _logprob_call(trainer: Any, inputs: dict[str, Tensor]) -> Callable[[], tuple[Tensor, Tensor]]:
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # [B, L]
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [B, L]
    keep, completion_mask = inputs["completion_ids"].shape[1], inputs["completion_mask"]

    def call() -> tuple[Tensor, Tensor]:
        trainer.model.zero_grad(set_to_none=True)
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, keep, compute_entropy=True
        )
        (logps * completion_mask).sum().backward()
        return logps.detach(), entropy.detach()

    return call


def _backbone_call(trainer: Any, inputs: dict[str, Tensor]) -> Callable[[], None]:
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # [B, L]
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [B, L]

    def call() -> None:
        trainer.model.zero_grad(set_to_none=True)
        trainer.model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state.sum().backward()

    return call


def _step_call(trainer: Any, inputs: dict[str, Tensor]) -> Callable[[], Tensor]:
    optimizer = trainer.create_optimizer()

    def call() -> Tensor:
        loss = trainer.compute_loss(trainer.model, inputs)
        trainer.accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return call


def _first_call(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and its peak bytes over the baseline (freed memory returned to the OS first)."""
    release_freed_memory("cpu")
    base = reset_peak("cpu")
    out = fn()
    return out, peak_bytes("cpu") - base


def measure(variant: str, part: str, shape: dict, model: str, out: str, threads: int) -> dict:
    """One trainer's ``part`` in this (fresh) process: its figures; the first call's values saved at ``out``."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    torch.set_num_threads(threads)
    shape_ = Shape(**shape)
    peers = _require_peers()
    with tempfile.TemporaryDirectory() as workdir:
        trainer = _trainer(peers, variant, shape_, model, workdir)
        inputs = _inputs(shape_)
        if part == "logprob":
            call = _logprob_call(trainer, inputs)
            (logps, entropy), peak = _first_call(call)
            figures = {"logprob_ms": time_ms(call, "cpu", warmup=0, repeat=shape_.repeat), "logprob_peak_bytes": peak}
            figures["backbone_ms"] = time_ms(_backbone_call(trainer, inputs), "cpu", warmup=1, repeat=shape_.repeat)
            torch.save({"logprobs": logps, "entropy": entropy}, out)
        else:
            before = [p.detach().clone() for p in trainer.model.parameters()]
            call = _step_call(trainer, inputs)
            loss, peak = _first_call(call)
            update = torch.cat(
                [(p.detach() - b).flatten() for p, b in zip(trainer.model.parameters(), before, strict=True)]
            )
            torch.save({"loss": loss, "update": update}, out)
            figures = {"step_ms": time_ms(call, "cpu", warmup=0, repeat=shape_.repeat), "step_peak_bytes": peak}
    return figures


def _compare(values: dict[tuple[str, str], dict[str, Tensor]]) -> dict[str, float]:
    """packloss's first-call values against TRL's: the relative errors (``ValuesDisagree`` past ``RTOL``)."""
    errors = {}
    for part, keys in (("logprob", ("logprobs", "entropy")), ("step", ("loss", "update"))):
        for key in keys:
            got, want = values["packloss", part][key], values["trl", part][key]
            errors[f"{key}_rel_err"] = check(f"trainers {key}", got.reshape(-1), want.reshape(-1), RTOL[key])
    return errors


def run(device: str, quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    """Both trainers' rows at ``SHAPES[quick]``, each part in a fresh process; the packloss row carries its
    ratios to TRL's and the relative errors of its values."""
    if device != "cpu":
        raise ValueError(f"packloss bench trainers runs on CPU only, got --device {device}")
    peers, why = _peers()
    if peers is None:
        return {"rows": [], "notes": [why]}
    report = progress or (lambda _description: None)
    shape, threads = SHAPES[quick], torch.get_num_threads()
    figures: dict[str, dict] = {variant: {} for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_model(shape, model)
        values = {}
        for part in PARTS:
            for variant in VARIANTS:
                report(f"trainers {variant} {part}")
                out = str(Path(tmp) / f"{variant}-{part}.pt")
                kwargs = dict(variant=variant, part=part, shape=dataclasses.asdict(shape), model=str(model), out=out,
                              threads=threads)  # fmt: skip
                figures[variant].update(run_fresh("packloss.tools.bench.trainers:measure", kwargs))
                values[variant, part] = torch.load(out)
        errors = _compare(values)
    prompts, completions = shape.lengths()
    length = max(prompts) + max(completions)
    positions = {"trl": shape.rows * (length - 1), "packloss": shape.rows * max(completions)}  # projected by the head
    rows = []
    for variant in VARIANTS:
        f = figures[variant]
        rows.append({
            "shape": shape.describe(), "variant": variant, "time_ms": f["step_ms"], "peak_bytes": f["step_peak_bytes"],
            "logprob_ms": f["logprob_ms"], "logprob_peak_MiB": f["logprob_peak_bytes"] / 2**20,
            "backbone_ms": f["backbone_ms"], "head_positions": positions[variant],
        })  # fmt: skip
    trl, ours = figures["trl"], figures["packloss"]
    rows[1].update(
        step_time_vs_trl=ours["step_ms"] / trl["step_ms"],
        step_peak_vs_trl=ours["step_peak_bytes"] / max(trl["step_peak_bytes"], 1),
        logprob_time_vs_trl=ours["logprob_ms"] / trl["logprob_ms"],
        logprob_peak_vs_trl=ours["logprob_peak_bytes"] / max(trl["logprob_peak_bytes"], 1),
        head_time_vs_trl=(ours["logprob_ms"] - ours["backbone_ms"]) / (trl["logprob_ms"] - trl["backbone_ms"]),
        **errors,
    )
    notes = [
        "head_positions: rows × positions the head projects; TRL 1.16 on CPU (no Triton) projects every position, "
        "prompts included, packloss the completion positions (padding included). On CUDA TRL projects only the "
        "positions with a label.",
        f"acceptance (issue 24): log-prob/entropy time ≤ 0.5× TRL's: {rows[1]['logprob_time_vs_trl']:.3g}; "
        f"peak ≤ 0.2× TRL's: {rows[1]['logprob_peak_vs_trl']:.3g}",
    ]
    return {"rows": rows, "notes": notes, "threads": threads, "torch": torch.__version__}
