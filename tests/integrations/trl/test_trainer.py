"""packloss.integrations.trl.PacklossGRPOTrainer against TRL 1.16's own GRPOTrainer.

End to end (CPU): a tiny ``LlamaForCausalLM`` and a word-level tokenizer built here, a dataset of four
prompts and a Python reward; TRL's ``GRPOTrainer`` and ``PacklossGRPOTrainer`` train two optimizer steps
of two accumulated micro-batches each (SGD, so a parameter update is the gradient itself), from the
same seed. Generation is TRL's sampling with the global torch generator, seeded by TRL from
``args.seed``; both runs draw the same numbers (the loss consumes none), so the completions are the
same, which is asserted. ``num_iterations=2`` makes the second step reuse the first step's completions
with TRL's old log-probs, so the ratio moves and clips (asserted where it must). PacklossGRPOTrainer
computes every log-prob with packloss's head (the default), TRL's with ``packloss_head=False``. Agreement: each
step's logged loss within 1e-6 absolute (losses are O(0.1), float32), every metric TRL logs within
1e-5 relative / 1e-6 absolute, and the parameters after each step within 1e-6 of their scale, where
each step moves them by more than 1e-2.

On TRL's padded batch (no model): ``_compute_loss`` of a bare ``PacklossGRPOTrainer`` against TRL's own
``_compute_loss`` on random float64 batches (tests/integrations/test_trl.py's data: ragged completions,
tool masks, a row without a loss token, vLLM sampling log-probs): loss and gradient within 1e-10, every
TRL metric within 1e-6, for every loss type × level × beta × vLLM correction, in training (3 micro-
batches) and evaluation, and per rank with two processes (the ranks' bookkeeping: gather and reduce are
the identity there).
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from conftest import ROOT
from packloss.integrations.trl import LOSS_TYPES, PacklossGRPOTrainer
from packloss.testing import run_gloo
from packloss.testing.dist import run_program
from packloss.testing.trl import OneProcess, bare_grpo_trainer
from tests.integrations.trl.harness import F64, assert_close, cases, compute, config, padded_batch, seed_of

DOC = ROOT / "docs" / "integrations" / "trl.md"
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(9)]
NOT_COMPARED = {"step_time", "epoch", "step", "learning_rate"}  # wall-clock and bookkeeping
PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


# ---------------------------------------------------------------------------------------------------
# End to end: a tiny model, two optimizer steps
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is several times faster on a shared CPU (and the same in both runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    vocab.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny Llama (a path, so that TRL can load the reference model from it), its tokenizer and
    the prompts. 12 tokens: ``<eos>`` is sampled often enough that completions are ragged."""
    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    dataset = Dataset.from_dict({"prompt": ["w1 w2", "w3 w4 w5", "w6", "w7 w8"]})
    return str(path), tokenizer(), dataset


def reward_w3(completions, **kwargs):
    return [c.count("w3") + 0.1 * len(c.split()) for c in completions]


class Snapshots(TrainerCallback):
    """The parameters after each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.detach().clone() for n, p in model.named_parameters()})


def train(tiny, trainer_cls, options: dict, **trainer_kwargs):
    path, tok, dataset = tiny
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="run-", dir=Path(path).parent),
        use_cpu=True,
        bf16=False,
        seed=3,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **options,
    )
    snapshots = Snapshots()
    trainer = trainer_cls(model=path, reward_funcs=reward_w3, args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[snapshots], **trainer_kwargs)  # fmt: skip
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and len(snapshots.steps) == 2
    return trainer, logs, [initial, *snapshots.steps]


def assert_same_run(trl_run, ours_run, ratio_moves: bool) -> None:
    """Same completions; each step's logged loss, TRL's metrics and parameters agree (module doc)."""
    (trl, trl_logs, trl_params), (ours, our_logs, our_params) = trl_run, ours_run
    assert list(ours._logs["completion"]) == list(trl._logs["completion"]), "generation differs between the runs"
    assert trl_logs[0]["completions/min_length"] < trl_logs[0]["completions/max_length"], "completions not ragged"
    for step, (expected, got) in enumerate(zip(trl_logs, our_logs, strict=True)):
        assert abs(got["loss"] - expected["loss"]) <= 1e-6, (step, got["loss"], expected["loss"])
        for key, value in expected.items():
            if key in NOT_COMPARED:
                continue
            assert key in got, f"step {step}: TRL logs {key!r}, PacklossGRPOTrainer does not"
            both_nan = math.isnan(got[key]) and math.isnan(value)
            assert both_nan or math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6), (step, key, got[key], value)
        assert "packloss/pg/loss" in got
        if ratio_moves and step == 1 and "clip_ratio/region_mean" in expected:
            assert expected["clip_ratio/region_mean"] > 0.05, "the second step should clip: the test would miss it"
    for step in (1, 2):
        scale = max(p.abs().max().item() for p in trl_params[step].values())
        moved = max((trl_params[step][n] - trl_params[step - 1][n]).abs().max().item() for n in trl_params[step])
        diff = max((our_params[step][n] - trl_params[step][n]).abs().max().item() for n in trl_params[step])
        assert moved > 1e-2, f"step {step} barely moved the parameters ({moved:.2e}): the comparison is vacuous"
        assert diff <= 1e-6 * scale, f"step {step}: parameters differ by {diff:.3e} (scale {scale:.3e})"


def _e2e_cases():
    out = {}
    for loss_type in LOSS_TYPES:
        for beta in (0.0, 0.04):
            options = dict(loss_type=loss_type, beta=beta, num_iterations=2)
            if loss_type == "cispo":
                options["epsilon_high"] = 1.2  # TRL's CISPO cap is absolute: one that binds sometimes
            out[f"{loss_type}-beta{beta}"] = options
    out.update(
        {
            "dapo-on_policy": dict(loss_type="dapo"),  # no old log-probs, a fresh generation per step
            "grpo-sequence": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2),
            "cispo-sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.2,
                                   num_iterations=2),
            "dapo-kl_k3": dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False, num_iterations=2),
            "grpo-entropy_bonus": dict(loss_type="grpo", entropy_coef=0.01, num_iterations=2),
            # TRL's controller: no bonus before the first step's entropy is known, then (entropy below the
            # target) the coefficient raised by the delta and applied
            "grpo-adaptive_entropy": dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.01,
                                          entropy_target=10.0, entropy_coef_delta=0.02, num_iterations=2),
            "grpo-masked_truncated": dict(loss_type="grpo", mask_truncated_completions=True, num_iterations=2),
            # the high-entropy minority: the policy gradient and the entropy bonus over the top 20%
            "grpo-top_entropy": dict(loss_type="grpo", top_entropy_quantile=0.2, entropy_coef=0.01, num_iterations=2),
            "dapo-top_entropy_sequence": dict(loss_type="dapo", importance_sampling_level="sequence",
                                              top_entropy_quantile=0.5, beta=0.04, num_iterations=2),
        }
    )  # fmt: skip
    return out


E2E = _e2e_cases()


@pytest.mark.parametrize("name", list(E2E))
def test_trainer_matches_trl_end_to_end(tiny, name):
    options = E2E[name]
    assert_same_run(
        train(tiny, GRPOTrainer, options), train(tiny, PacklossGRPOTrainer, options), options.get("num_iterations") == 2
    )


def test_trls_head_end_to_end(tiny):
    """``packloss_head=False``: TRL's fused head computes the log-probs, packloss the loss."""
    options = dict(loss_type="grpo", beta=0.04, entropy_coef=0.01, num_iterations=2)
    ours = train(tiny, PacklossGRPOTrainer, options, packloss_head=False)
    assert not ours[0].packloss_head
    assert_same_run(train(tiny, GRPOTrainer, options), ours, ratio_moves=True)


def test_step_normalization(tiny):
    """``packloss_normalization="step"``: dapo equals TRL's dapo (``steps_per_generation == G``); bnpo
    becomes the token mean over the step, i.e. TRL's dapo, where TRL's bnpo (a mean per micro-batch)
    differs."""
    options = dict(num_iterations=2)
    trl_dapo = train(tiny, GRPOTrainer, dict(options, loss_type="dapo"))
    assert_same_run(trl_dapo, train(tiny, PacklossGRPOTrainer, dict(options, loss_type="dapo"),
                                    packloss_normalization="step"), ratio_moves=True)  # fmt: skip
    step_bnpo = train(tiny, PacklossGRPOTrainer, dict(options, loss_type="bnpo"), packloss_normalization="step")
    assert_same_run(trl_dapo, step_bnpo, ratio_moves=True)
    trl_bnpo = train(tiny, GRPOTrainer, dict(options, loss_type="bnpo"))
    assert abs(trl_bnpo[1][0]["loss"] - step_bnpo[1][0]["loss"]) > 1e-4, "TRL's bnpo should differ here"


def test_options_are_checked_before_the_models_load(tiny):
    path, tok, dataset = tiny

    def build(normalization="trl", **options):
        args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="run-", dir=Path(path).parent), use_cpu=True, report_to=[],
                          per_device_train_batch_size=4, num_generations=4, **options)  # fmt: skip
        return PacklossGRPOTrainer("no/such-model", reward_w3, args, dataset, packloss_normalization=normalization)

    with pytest.raises(NotImplementedError, match="top_entropy_quantile < 1 and an entropy bonus"):
        build("step", top_entropy_quantile=0.5, entropy_coef=0.01)
    with pytest.raises(ValueError, match="packloss_normalization must be one of"):
        build("tokens")
    with pytest.raises(ValueError, match="steps_per_generation .* multiple of gradient_accumulation_steps"):
        build("step", gradient_accumulation_steps=2, steps_per_generation=3)


# ---------------------------------------------------------------------------------------------------
# On TRL's padded batch: _compute_loss against TRL's, every option
# ---------------------------------------------------------------------------------------------------


def bare_trl_trainer(cfg, world: int = 1) -> GRPOTrainer:
    """A bare GRPOTrainer (:func:`~packloss.testing.trl.bare_grpo_trainer`); ``world``: the number of
    processes it believes it runs on (its gather and reduce stay the identity, so each rank sees the
    same data)."""
    trainer = bare_grpo_trainer(GRPOTrainer, cfg)
    trainer.accelerator.num_processes = world
    return trainer


def packloss_trainer(cfg, world: int = 1) -> PacklossGRPOTrainer:
    """A bare PacklossGRPOTrainer with the attributes of :func:`bare_trl_trainer`'s."""
    trainer = object.__new__(PacklossGRPOTrainer)
    trainer.__dict__.update(bare_trl_trainer(cfg, world).__dict__)
    trainer._init_packloss("trl")
    return trainer


def assert_same_loss_and_metrics(cfg, b, micro_batches, old_given=True, mode="train", world=1):
    trl, ours = bare_trl_trainer(cfg, world), packloss_trainer(cfg, world)
    expected = compute(trl, cfg, b, micro_batches, old_given, mode)
    got = compute(ours, cfg, b, micro_batches, old_given, mode)
    assert_close(got, expected)
    (g_expected,) = torch.autograd.grad(expected, b.logps, retain_graph=True)
    (g_got,) = torch.autograd.grad(got, b.logps)
    assert_close(g_got, g_expected)
    for key, values in trl._metrics[mode].items():
        assert key in ours._metrics[mode], f"TRL logs {key!r}, PacklossGRPOTrainer does not"
        got, want = torch.tensor(ours._metrics[mode][key], dtype=F64), torch.tensor(values, dtype=F64)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True), (key, got, want)
    return ours


@pytest.mark.parametrize("loss_type, level, beta, is_case", list(cases(accepted_only=True)))
def test_compute_loss_matches_trl_on_its_batch(loss_type, level, beta, is_case):
    """3 micro-batches of 4 rows, one row without a loss token (TRL's grpo/sapo mean counts it, and so
    does the trainer's "trl" normalisation)."""
    cfg = config(loss_type, level, beta, is_case, rows=4, accumulation=3)
    b = padded_batch(seed=len(loss_type + level + beta + is_case), rows=12, empty_rows=(6,))
    ours = assert_same_loss_and_metrics(cfg, b, [slice(0, 4), slice(4, 8), slice(8, 12)], is_case != "on_policy")
    assert any(key.startswith("packloss/") for key in ours._metrics["train"])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_compute_loss_matches_trl_in_evaluation(loss_type):
    """Evaluation: TRL's normalisers without accumulation (``num_items_in_batch`` is the eval batch's)."""
    cfg = config(loss_type, "token", "beta_kl_bias_corrected", "token_truncate", rows=6, accumulation=2,
                 entropy_coef=0.02)  # fmt: skip
    b = padded_batch(seed=31, rows=6, empty_rows=(4,))
    assert_same_loss_and_metrics(cfg, b, [slice(0, 6)], mode="eval")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_compute_loss_matches_trl_per_rank(loss_type):
    """Two processes: TRL's loss is per rank (DDP averages); packloss's a rank's share of the step's
    (summed), so the trainer returns W × it, with ``from_trl``'s constants counted over the W ranks."""
    cfg = config(loss_type, "token", "beta_kl_bias_corrected", "token_truncate", rows=4, accumulation=2,
                 entropy_coef=0.02)  # fmt: skip
    b = padded_batch(seed=37, rows=8, empty_rows=(3,))
    assert_same_loss_and_metrics(cfg, b, [slice(0, 4), slice(4, 8)], world=2)


TOP_ENTROPY = {
    "dapo-bonus": dict(loss_type="dapo", entropy_coef=0.02),
    "grpo-sequence-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "bnpo-adaptive": dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0,
                          entropy_coef_delta=0.02, entropy_coef_min=0.0, entropy_coef_max=1.0),
    "dr_grpo-vllm": dict(loss_type="dr_grpo", use_vllm=True, vllm_importance_sampling_mode="token_truncate",
                         vllm_importance_sampling_clip_min=0.5, entropy_coef=0.02),
}  # fmt: skip


@pytest.fixture
def trl_pads_on_one_process(monkeypatch):
    """TRL's ``get_high_entropy_mask`` pads across processes: the identity on one process."""
    monkeypatch.setattr(OneProcess, "pad_across_processes", staticmethod(lambda x, **kwargs: x), raising=False)


@pytest.mark.usefixtures("trl_pads_on_one_process")
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", sorted(TOP_ENTROPY))
def test_compute_loss_matches_trl_with_top_entropy_quantile(name, mode):
    """``top_entropy_quantile=0.3``: TRL's mask per call, and the entropy bonus (static or adaptive) over
    the kept tokens. Entropies in float32, the trainer's dtype (TRL's quantile is float32 whatever theirs):
    the gradient within 1e-10, the loss within 1e-7 (TRL sums the bonus in float32, packloss in float64),
    every TRL metric as above; the bonus's packloss metric is the kept tokens' mean entropy."""
    options = TOP_ENTROPY[name]
    level = options.get("importance_sampling_level", "token")
    cfg = config(options["loss_type"], level, "beta0", "off", rows=4, accumulation=2, top_entropy_quantile=0.3)
    for key, value in options.items():
        setattr(cfg, key, value)
    b = padded_batch(seed=seed_of(name, mode, "top_entropy"), rows=8, empty_rows=(5,))
    b.entropies = b.entropies.float()
    trl, ours = bare_trl_trainer(cfg), packloss_trainer(cfg)
    micro = [slice(0, 4), slice(4, 8)] if mode == "train" else [slice(0, 8)]
    for _ in range(2):  # the adaptive coefficient moves after the first step
        expected = compute(trl, cfg, b, micro, mode=mode)
        got = compute(ours, cfg, b, micro, mode=mode)
        assert_close(got, expected, rtol=1e-7)
        (g_expected,) = torch.autograd.grad(expected, b.logps, retain_graph=True)
        (g_got,) = torch.autograd.grad(got, b.logps)
        assert_close(g_got, g_expected)
    assert ours.entropy_coef == trl.entropy_coef
    for key, values in trl._metrics[mode].items():
        got, want = torch.tensor(ours._metrics[mode][key], dtype=F64), torch.tensor(values, dtype=F64)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True), (key, got, want)
    kept = ours._metrics[mode]["packloss/pg/high_entropy"]
    assert all(0.2 < k < 0.5 for k in kept), kept
    if "entropy" in ours.packloss_recipe.components:
        kept_entropy, all_entropy = ours._metrics[mode]["packloss/entropy/entropy"], trl._metrics[mode]["entropy"]
        assert all(a > b for a, b in zip(kept_entropy, all_entropy, strict=True))


TWO_RANKS = """
import torch
import torch.distributed as dist
from trl import GRPOTrainer

from packloss.integrations.trl import PacklossGRPOTrainer
from packloss.testing.trl import bare_grpo_trainer
from tests.integrations.trl.harness import compute, config, padded_batch


class Ranks:
    # TRL's accelerator over the gloo group: gather, reduce, pad_across_processes
    sync_gradients = True

    def __init__(self):
        self.num_processes = dist.get_world_size()

    def gather(self, x):
        x = x[None] if x.dim() == 0 else x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.num_processes)]
        dist.all_gather(parts, x)
        return torch.cat(parts)

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        x = x.clone()
        dist.all_reduce(x)
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0, pad_first=False):
        longest = int(self.gather(torch.tensor([x.shape[0]])).max())
        return torch.cat([x, x.new_full((longest - x.shape[0], *x.shape[1:]), pad_index)])


def trainers(cfg):
    trl = bare_grpo_trainer(GRPOTrainer, cfg)
    trl.accelerator = Ranks()
    ours = object.__new__(PacklossGRPOTrainer)
    ours.__dict__.update(bare_grpo_trainer(GRPOTrainer, cfg).__dict__)
    ours.accelerator = Ranks()
    ours._init_packloss("trl")
    return trl, ours


def worker(rank, world_size):
    out = {}
    for name, options in CASES.items():
        cfg = config(options["loss_type"], "token", "beta0", "off", rows=4, accumulation=2, top_entropy_quantile=0.3)
        for key, value in options.items():
            setattr(cfg, key, value)
        b = padded_batch(seed=41 + rank, rows=8, empty_rows=(5,) if rank else ())
        b.entropies = b.entropies.float() * (1 + rank)  # rank 1's entropies are higher: a local quantile differs
        trl, ours = trainers(cfg)
        micro = [slice(0, 4), slice(4, 8)]
        expected, got = compute(trl, cfg, b, micro), compute(ours, cfg, b, micro)
        grads = [torch.autograd.grad(x, b.logps, retain_graph=True)[0] for x in (expected, got)]
        mask = b.completion_mask * b.tool_mask
        local = bare_grpo_trainer(GRPOTrainer, cfg)  # one process: TRL's mask over this rank's tokens
        local.accelerator.pad_across_processes = lambda x, **kwargs: x
        kept = [int(t.get_high_entropy_mask(b.entropies[:4], mask[:4], 0.7).sum()) for t in (trl, local)]
        out[name] = (expected.detach(), got.detach(), *grads, dict(trl._metrics["train"]),
                     dict(ours._metrics["train"]), kept)
    dist.barrier()
    return out
"""


def test_two_ranks_take_trls_quantile_over_both_ranks():
    """Two gloo ranks with different completions, TRL's accelerator calls as collectives: TRL's mask
    gathers both ranks' entropies (each rank keeps a different number of tokens than with its own
    quantile), and PacklossGRPOTrainer's loss, gradient and TRL's metrics equal TRL's on each rank."""
    cases = {k: TOP_ENTROPY[k] for k in ("dapo-bonus", "bnpo-adaptive")}
    ranks = run_gloo(run_program, world_size=2, args=(f"CASES = {cases!r}\n" + TWO_RANKS, "worker"), timeout=180)
    for rank in ranks:
        for name, (expected, got, g_expected, g_got, trl_metrics, our_metrics, kept) in rank.items():
            assert_close(got, expected, rtol=1e-7)
            assert_close(g_got, g_expected)
            for key, values in trl_metrics.items():
                got_m, want = torch.tensor(our_metrics[key], dtype=F64), torch.tensor(values, dtype=F64)
                assert torch.allclose(got_m, want, rtol=1e-6, atol=1e-7, equal_nan=True), (name, key, got_m, want)
            assert kept[0] != kept[1], (name, kept)


def test_nan_sampling_logprob_is_ratio_one_as_in_trl():
    """A token vLLM could not score (NaN) gets ρ = 1, as TRL (``from_trl``'s recipe alone would be NaN)."""
    cfg = config("dapo", "token", "beta0", "token_truncate", rows=4, accumulation=1)
    b = padded_batch(seed=13, rows=4)
    b.sampling[0, 0] = float("nan")
    assert_same_loss_and_metrics(cfg, b, [slice(0, 4)])


# ---------------------------------------------------------------------------------------------------
# The docs
# ---------------------------------------------------------------------------------------------------


def test_docs_snippet_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, f"no python block in {DOC}"
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(DOC), "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, PacklossGRPOTrainer) and trainer.state.global_step == 2
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all("packloss/pg/loss" in entry for entry in logged)


def test_adaptive_entropy_moves_and_applies_the_coefficient(tiny):
    """The adaptive case above is not vacuous: TRL's controller raised the coefficient after each step
    (the entropy stays below the target), so the second step applied a non-zero bonus, and packloss's
    run logged the same coefficients."""
    options = E2E["grpo-adaptive_entropy"]
    trl_run, ours_run = train(tiny, GRPOTrainer, options), train(tiny, PacklossGRPOTrainer, options)
    assert [log["entropy_coef"] for log in trl_run[1]] == pytest.approx([0.03, 0.05])
    assert [log["entropy_coef"] for log in ours_run[1]] == pytest.approx([0.03, 0.05])
    assert ours_run[0].packloss_recipe.components["entropy"].loss.coef.item() == pytest.approx(0.03)
