"""packloss.integrations.trl.head: PacklossGRPOTrainer's log-probs and entropy from packloss's fused head
against TRL 1.16's own ``_get_per_token_logps_and_entropies`` (TRL's fused head, as TRL's ``__init__``
installs it), on tiny Qwen2 models built and saved here (no downloads): temperature ≠ 1, a tied embedding,
``cast_lm_head_to_fp32`` on a bfloat16 model, softcapping with a logit scale, Granite's ``logits_scaling``,
a LoRA policy whose reference is the adapter switched off; TRL's batch chunking (``batch_size``). Then the
loss and gradient of one training step against stock TRL's, the structural fact (no tensor storage of
even half of the completion logits on packloss's path; TRL's path makes more than all of them) and the
refusals (a biased or unknown head, MoE load balancing, ``packloss_head`` not a bool).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)
from trl import GRPOConfig, GRPOTrainer

from packloss.integrations.trl import PacklossGRPOTrainer
from packloss.integrations.trl.head import HeadCall, head_spec, install_head
from packloss.testing import OpCounter
from packloss.testing.trl import completion_batch

VOCAB = 300
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
            initializer_range=0.3)  # fmt: skip  # peaked next-token distributions, not near-uniform ones
PROMPTS, COMPLETIONS = (5, 3, 4, 2), (7, 2, 5, 1)  # left-padded prompts, ragged completions


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trl-head")


def saved_qwen2(workdir: Path, name: str, vocab: int = VOCAB, **config) -> str:
    path = workdir / name
    if not path.exists():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **TINY, **config)).save_pretrained(path)
    return str(path)


def build(trainer_cls, model, workdir: Path, peft_config=None, packloss_head=None, **options):
    """A trainer on ``model`` (a path or a model) with ``GRPOConfig(**options)``: beta and the entropy
    bonus on (a reference model; the entropy's gradient)."""
    head = {} if packloss_head is None else {"packloss_head": packloss_head}
    options = {"beta": 0.04, **options}
    args = GRPOConfig(output_dir=tempfile.mkdtemp(dir=workdir), use_cpu=True, report_to=[], bf16=False,
                      per_device_train_batch_size=4, num_generations=4, entropy_coef=0.01, **options)  # fmt: skip
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w1", unk_token="w2")
    dataset = Dataset.from_dict({"prompt": ["w3", "w4"]})
    torch.manual_seed(1)  # the same LoRA initialisation in both trainers
    return trainer_cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                       **head)  # fmt: skip


def batch(vocab: int = VOCAB, completions=COMPLETIONS) -> dict[str, torch.Tensor]:
    return completion_batch(vocab, PROMPTS, completions, seed=4)


def logps_and_entropies(trainer, model, inputs, batch_size=None, entropy=True):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].shape[1]
    return trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size, compute_entropy=entropy)[:2]


def weighted_sum(logps, entropies):
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(logps.shape, generator=g), torch.randn(logps.shape, generator=g)
    return (logps * a).sum() + (entropies * b).sum()


def trainable(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]


CASES = {
    "temperature": (dict(), dict(temperature=0.7), None),
    "tied": (dict(tie_word_embeddings=True), dict(temperature=1.3), None),
    "fp32_head_on_bf16": (dict(), dict(cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"}), None),
    "softcap_and_scale": (dict(final_logit_softcapping=10.0, logit_scale=1.5), dict(temperature=0.9), None),
    "logits_scaling": (dict(logits_scaling=0.5), dict(), None),
    "lora": (dict(), dict(temperature=0.8), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_entropy_and_their_gradient_equal_trls(workdir, case):
    model_config, options, peft_config = CASES[case]
    path = saved_qwen2(workdir, case, **model_config)
    trl = build(GRPOTrainer, path, workdir, peft_config, **options)
    ours = build(PacklossGRPOTrainer, path, workdir, peft_config, **options)
    assert ours.packloss_head and (ours.ref_model is None) == (peft_config is not None)
    inputs = batch()
    scored = inputs["completion_mask"].bool()  # [B, K]
    for batch_size in (None, 2):  # TRL's batch chunking: two model calls of two rows
        want = logps_and_entropies(trl, trl.model, inputs, batch_size)
        got = logps_and_entropies(ours, ours.model, inputs, batch_size)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape == (4, 7) and g.dtype == torch.float32
            assert (w[~scored] == 0).all() and (g[~scored] == 0).all()
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert want[0][scored].abs().min() > 0 and want[1][scored].std() > 0.1  # not trivially equal
    grads_want = torch.autograd.grad(weighted_sum(*want), [p for _, p in trainable(trl)])
    grads_got = torch.autograd.grad(weighted_sum(*got), [p for _, p in trainable(ours)])
    for (name, _), g, w in zip(trainable(ours), grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item() + 1e-7, msg=name)
    with torch.no_grad():  # the reference model's (or, under LoRA, the adapter switched off: TRL's ref path)
        ref_model = trl.model if trl.ref_model is None else trl.ref_model
        ref_want, _ = logps_and_entropies(trl, ref_model, inputs, entropy=False)
        ref_got, _ = logps_and_entropies(
            ours, ours.model if ours.ref_model is None else ours.ref_model, inputs, entropy=False
        )
    torch.testing.assert_close(ref_got, ref_want, rtol=1e-5, atol=1e-5)


def step_inputs(trainer, inputs):
    """The micro-batch with the trainer's own reference log-probs (its reference path)."""
    with torch.no_grad():
        ref, _ = logps_and_entropies(trainer, trainer.ref_model, inputs, entropy=False)
    return dict(inputs, ref_per_token_logps=ref)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_one_training_step_equals_stock_trl(workdir, loss_type):
    path = saved_qwen2(workdir, "tied", tie_word_embeddings=True)
    trl = build(GRPOTrainer, path, workdir, loss_type=loss_type, temperature=0.8)
    ours = build(PacklossGRPOTrainer, path, workdir, loss_type=loss_type, temperature=0.8)
    inputs = batch()
    loss_want = trl._compute_loss(trl.model, step_inputs(trl, inputs))
    loss_got = ours._compute_loss(ours.model, step_inputs(ours, inputs))
    torch.testing.assert_close(loss_got, loss_want, rtol=1e-5, atol=1e-7)
    grads_want = torch.autograd.grad(loss_want, [p for _, p in trainable(trl)])
    grads_got = torch.autograd.grad(loss_got, [p for _, p in trainable(ours)])
    assert max(g.abs().max() for g in grads_want) > 1e-3
    for (name, _), g, w in zip(trainable(ours), grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item() + 1e-8, msg=name)


class LargestStorage(TorchDispatchMode):
    """The largest storage (bytes) of any tensor an aten op returns, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("packloss_head", [True, False])
def test_packloss_path_never_holds_the_logits(workdir, packloss_head):
    """V = 4096 (4 vocabulary blocks of 1024 on CPU), H = 32, B·K = 4 · 24 completion positions: the head's
    weight and its gradient are a third of the completion logits ``[B·K, V]``, packloss's blocks a quarter.
    TRL's path (on CPU: every position, prompts included, in a 32768-wide tile) holds more than all."""
    vocab = 4096
    path = saved_qwen2(workdir, "wide", vocab=vocab)
    trainer = build(PacklossGRPOTrainer, path, workdir, packloss_head=packloss_head)
    inputs = batch(vocab, completions=(24, 10, 17, 3))
    logits_bytes = inputs["completion_ids"].numel() * vocab * 4  # float32 [B·K, V]
    with LargestStorage() as probe:
        logps, entropies = logps_and_entropies(trainer, trainer.model, inputs)
        weighted_sum(logps, entropies).backward()
    if packloss_head:
        assert probe.nbytes < logits_bytes / 2, (probe.nbytes, logits_bytes)
    else:
        assert probe.nbytes >= logits_bytes, (probe.nbytes, logits_bytes)


def test_the_head_module_is_never_called(workdir):
    path = saved_qwen2(workdir, "temperature")
    trainer = build(PacklossGRPOTrainer, path, workdir)

    def refuse(*args, **kwargs):
        raise AssertionError("lm_head was called")

    trainer.model.lm_head.forward = refuse
    logps, entropies = logps_and_entropies(trainer, trainer.model, batch())
    weighted_sum(logps, entropies).backward()
    assert trainer.model.lm_head.weight.grad.abs().max() > 0


def test_a_call_without_packloss_head_goes_to_the_replaced_forward(workdir):
    """Generation and TRL's own fused-head calls are untouched by the patch."""
    trainer = build(PacklossGRPOTrainer, saved_qwen2(workdir, "temperature"), workdir)
    model, inputs = trainer.model, batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    assert model(input_ids=ids).logits.shape == (*ids.shape, VOCAB)
    labels = ids.clone()
    fused = model(input_ids=ids, labels=labels, fused_lm_head=True)  # TRL's head: every position
    ours = model(input_ids=ids, labels=labels, packloss_head=HeadCall(ids.shape[1] - 1, 1.0, True, False))
    torch.testing.assert_close(ours.log_probs, fused.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.entropy, fused.entropy, rtol=1e-5, atol=1e-5)


def test_head_spec_reads_the_config():
    def spec(**config):
        return head_spec(Qwen2ForCausalLM(Qwen2Config(vocab_size=8, **TINY, **config)))

    assert (spec().softcap, spec().logit_scale) == (None, 1.0)
    assert (spec(final_logit_softcapping=30.0).softcap, spec(logit_scale=0.5).logit_scale) == (30.0, 0.5)
    assert spec(logits_scaling=4.0).logit_scale == 0.25  # Granite divides
    assert spec(lm_head_multiplier=3.0, logits_scaling=4.0).logit_scale == 3.0  # the first field found


def tiny_model(**config) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, **TINY, **config))


def test_refuses_a_head_with_a_bias(workdir):
    model = tiny_model()
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    with pytest.raises(ValueError, match="bias-free output layers only.*packloss_head=False"):
        build(PacklossGRPOTrainer, model, workdir, beta=0.0)
    model = tiny_model()
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert not build(
        PacklossGRPOTrainer, model, workdir, packloss_head=False, beta=0.0
    ).packloss_head  # TRL's head takes it


def test_refuses_an_unknown_head_type():
    model = tiny_model()
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(32, VOCAB, bias=False))
    with pytest.raises(TypeError, match="torch.nn.Linear output layer; Qwen2ForCausalLM's is Sequential"):
        install_head(model)
    with pytest.raises(TypeError, match="a backbone"):
        install_head(model.model)


def test_install_is_idempotent():
    model = tiny_model()
    spec = install_head(model)
    forward = model.forward
    assert install_head(model) is spec and model.forward is forward


def test_refuses_moe_load_balancing(workdir):
    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=VOCAB, **TINY, num_experts=2, num_experts_per_tok=1,
                                             moe_intermediate_size=16, shared_expert_intermediate_size=16))  # fmt: skip
    with pytest.raises(NotImplementedError, match="MoE load-balancing loss.*packloss_head=False"):
        build(PacklossGRPOTrainer, moe, workdir, beta=0.0)


def test_packloss_head_must_be_a_bool(workdir):
    with pytest.raises(TypeError, match="packloss_head"):
        build(PacklossGRPOTrainer, "no/such-model", workdir, packloss_head="yes")


def test_head_call_is_checked():
    with pytest.raises(ValueError, match="HeadCall.keep"):
        HeadCall(0, 1.0, True, False)
    with pytest.raises(ValueError, match="HeadCall.temperature"):
        HeadCall(3, 0.0, True, False)
    with pytest.raises(ValueError, match="entropy_grad=True needs entropy=True"):
        HeadCall(3, 1.0, False, True)


def test_the_head_adds_no_host_sync(workdir):
    """The log-prob call syncs exactly as often as the backbone alone does (the head: never)."""
    trainer = build(PacklossGRPOTrainer, saved_qwen2(workdir, "temperature"), workdir)
    inputs = batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with OpCounter() as call:
        weighted_sum(*logps_and_entropies(trainer, trainer.model, inputs)).backward()
    with OpCounter() as backbone:
        trainer.model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state.sum().backward()
    assert call.num_syncs == backbone.num_syncs, (call.syncs, backbone.syncs)
    assert call.total > backbone.total
