"""packloss.integrations.hf: a patched Hugging Face causal LM equals its own logits path (tiny models, no downloads)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packloss.integrations.hf import causal_lm_logprobs, next_token_labels, patch_causal_lm  # noqa: E402

VOCAB = 97
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def _qwen2_tied() -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True))


@pytest.fixture(params=[_llama, _qwen2_tied], ids=["llama", "qwen2-tied"])
def model(request) -> torch.nn.Module:
    torch.manual_seed(0)
    return request.param().float()


def _batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    labels = next_token_labels(input_ids)
    labels[0, :3] = -100  # a prompt without labels
    temperature = torch.rand(2, 13, generator=g) + 0.5
    return input_ids, labels, temperature


def _reference(model, input_ids, labels, temperature):
    """Log-probs and entropy from the model's own ``[B, S, V]`` logits."""
    logits = model(input_ids).logits.float()  # [B, S, V]
    logp = torch.log_softmax(logits / temperature[..., None], dim=-1)
    valid = labels != -100
    lp = logp.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1)
    return torch.where(valid, lp, 0.0), -(logp.exp() * logp).sum(-1)


def _loss_and_grads(model, lp, ent):
    g = torch.Generator().manual_seed(2)
    loss = (lp * torch.randn(lp.shape, generator=g)).sum() + (ent * torch.randn(ent.shape, generator=g)).sum()
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_patched_model_matches_logits_path(model, entropy_grad):
    input_ids, labels, temperature = _batch()
    ref_lp, ref_ent = _reference(model, input_ids, labels, temperature)
    ref_ent = ref_ent if entropy_grad else ref_ent.detach()
    ref_grads = _loss_and_grads(model, ref_lp, ref_ent)

    patch_causal_lm(model, chunk_size=10, vocab_chunk_size=32)
    out = model(input_ids, labels=labels, temperature=temperature, entropy_grad=entropy_grad)
    assert not hasattr(out, "logits")
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    grads = _loss_and_grads(model, out.logprobs, out.entropy if entropy_grad else out.entropy.detach())
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_tied_weight_stays_tied_and_shared():
    torch.manual_seed(0)
    model = patch_causal_lm(_qwen2_tied())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids, labels, _ = _batch()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # an update after patching is seen by the fused head
    ref_lp, _ = _reference(model, input_ids, labels, torch.ones(2, 13))
    out = model(input_ids, labels=labels)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=1e-5)


def test_without_labels_runs_original_forward(model):
    input_ids, _, _ = _batch()
    want = model(input_ids).logits
    patch_causal_lm(model)
    torch.testing.assert_close(model(input_ids).logits, want)


def test_helper_equals_patch(model):
    input_ids, labels, temperature = _batch()
    out = causal_lm_logprobs(model, input_ids, labels, temperature=temperature, return_entropy=False)
    assert out.entropy is None
    patched = patch_causal_lm(model)(input_ids, labels=labels, temperature=temperature)
    torch.testing.assert_close(out.logprobs, patched.logprobs)


def test_return_dict_false_returns_a_tuple(model):
    input_ids, labels, temperature = _batch()
    want = causal_lm_logprobs(model, input_ids, labels, temperature=temperature)
    got = patch_causal_lm(model)(input_ids, labels=labels, temperature=temperature, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want.to_tuple())  # logprobs, entropy, cache
    torch.testing.assert_close(got[0], want.logprobs)
    torch.testing.assert_close(got[1], want.entropy)
    with pytest.raises(TypeError, match="return_dict"):
        causal_lm_logprobs(model, input_ids, labels, return_dict="no")


def test_next_token_labels():
    ids = torch.tensor([[5, 6, 7], [1, 2, 3]])
    assert torch.equal(next_token_labels(ids), torch.tensor([[6, 7, -100], [2, 3, -100]]))


def test_bias_and_bad_shapes_raise(model):
    input_ids, labels, _ = _batch()
    with pytest.raises(ValueError, match="labels"):
        causal_lm_logprobs(model, input_ids, labels[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        causal_lm_logprobs(model, input_ids, labels, temperature=torch.ones(2, 12))
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    with pytest.raises(ValueError, match="bias"):
        patch_causal_lm(model)
    with pytest.raises(TypeError, match="model"):
        patch_causal_lm(torch.nn.Linear(3, 3))


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_chunk_sizes_raise(bad: int) -> None:
    model = _llama()
    input_ids, labels, _ = _batch()
    with pytest.raises(ValueError, match="chunk_size"):
        causal_lm_logprobs(model, input_ids, labels, chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size"):  # at patch time, not at the first call
        patch_causal_lm(model, chunk_size=bad)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        patch_causal_lm(model, vocab_chunk_size=bad)
    assert not hasattr(model, "_packloss_original_forward")


def test_check_labels_reaches_the_head_through_the_patch(model):
    """A label outside the vocabulary used to get −logZ silently: the opt-in check is reachable."""
    input_ids, _, _ = _batch()
    labels = next_token_labels(input_ids)
    labels[0, 0] = model.lm_head.weight.shape[0]  # one past the vocabulary
    patch_causal_lm(model)
    with pytest.raises(ValueError, match="labels"):
        model(input_ids, labels=labels, check_labels=True)
    assert torch.isfinite(model(input_ids, labels=labels).logprobs).all()  # unchecked: as documented
