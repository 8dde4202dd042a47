"""The demo's models and sampler: a tiny Llama patched with the fused head, generation (it plays
the inference engine), greedy evaluation, and the training forward that DDP wraps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from packloss.core.outputs import Outputs
from packloss.integrations.hf import patch_causal_lm
from packloss.tools.demo.task import BOS, EOS, PAD, VOCAB_SIZE, Task, encode_prompt, encode_target, score

if TYPE_CHECKING:
    from packloss.tools.demo.bins import Bin

__all__ = [
    "ModelSize",
    "build_model",
    "Rollout",
    "generate",
    "target_rollout",
    "evaluate",
    "packed_logprobs",
    "packed_hidden",
    "Policy",
]


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    intermediate: int


def build_model(size: ModelSize, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` of ``size`` on the demo vocabulary, patched with
    :func:`packloss.integrations.hf.patch_causal_lm` (``model(ids, labels=...)`` returns fused-head
    log-probs)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        max_position_embeddings=32,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    return patch_causal_lm(model.to(device))


@dataclass
class Rollout:
    """One prompt and its completion; ``logprobs`` ``[len(completion)]`` are the sampling pass's
    log-probs of the completion tokens (the inference log-probs), ``kl`` the per-token exact
    ``KL(student‖teacher)`` when a teacher was given."""

    digits: str
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    reward: float
    exact: bool
    kl: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


def _last_logprobs(model: nn.Module, ids: Tensor, attention: Tensor) -> Tensor:
    """``[B, V]`` float32 log-probs of the next token of left-padded ``ids [B, T]``."""
    positions = (attention.cumsum(1) - 1).clamp_min(0)  # [B, T]
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]  # [B, V]
    return torch.log_softmax(logits.float(), dim=-1)


def _left_padded(encoded: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """``(ids [B, T], attention [B, T])`` of the prompts, left-padded to the longest."""
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), PAD, dtype=torch.long)
    attention = torch.zeros(len(encoded), width, dtype=torch.long)
    for b, e in enumerate(encoded):
        ids[b, width - len(e) :] = torch.tensor(e)
        attention[b, width - len(e) :] = 1
    return ids.to(device), attention.to(device)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    generator: torch.Generator | None = None,
    teacher: nn.Module | None = None,
    batch_size: int = 512,
) -> list[Rollout]:
    """Complete ``prompts``: sampled at temperature 1 with ``generator``, greedy without one.

    A completion stops at its first ``$`` or after ``len(answer) + 1`` tokens. With ``teacher``,
    each rollout also carries the exact per-token ``KL(model‖teacher)`` over the vocabulary.
    """
    out: list[Rollout] = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        encoded = [encode_prompt(p) for p in chunk]
        ids, attention = _left_padded(encoded, device)
        tokens, logprobs, kls = [], [], []
        for _ in range(max_new_tokens):
            logp = _last_logprobs(model, ids, attention)  # [B, V]
            if generator is None:
                nxt = logp.argmax(-1)  # [B]
            else:
                nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)  # [B]
            if teacher is not None:
                ref = _last_logprobs(teacher, ids, attention)  # [B, V]
                kls.append((logp.exp() * (logp - ref)).sum(-1))  # [B]
            tokens.append(nxt)
            logprobs.append(logp.gather(1, nxt[:, None]).squeeze(1))  # [B]
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            attention = torch.cat([attention, torch.ones_like(nxt[:, None])], dim=1)
        tok = torch.stack(tokens, 1).tolist()  # sync-ok: the sampler hands tokens to the host once per batch
        lps = torch.stack(logprobs, 1).tolist()  # sync-ok: sampler output
        kl_rows = torch.stack(kls, 1).tolist() if kls else None  # sync-ok: sampler output
        for b, digits in enumerate(chunk):
            out.append(_rollout(digits, encoded[b], tok[b], lps[b], kl_rows[b] if kl_rows else None))
    return out


def _rollout(digits: str, prompt: list[int], row: list[int], lps: list[float], kl: list[float] | None) -> Rollout:
    """The rollout of one generated row: cut after the first ``$`` (or ``len(answer) + 1`` tokens), scored."""
    row = row[: len(digits) + 2]
    length = row.index(EOS) + 1 if EOS in row else len(row)
    reward, exact = score(digits, row[:length])
    return Rollout(digits, prompt, row[:length], lps[:length], reward, exact, kl[:length] if kl else [])


def target_rollout(digits: str) -> Rollout:
    """The reference answer as a rollout (SFT data)."""
    completion = encode_target(digits)
    return Rollout(digits, encode_prompt(digits), completion, [0.0] * len(completion), 1.0, True)


def evaluate(model: nn.Module, task: Task, teacher: nn.Module | None = None) -> dict[str, float | None]:
    """Greedy completions of the held-out prompts: mean reward, exact-match rate and (with ``teacher``)
    the mean per-token ``KL(model‖teacher)`` over the completion tokens."""
    model.eval()
    rollouts = generate(model, task.eval_prompts, task.max_new_tokens, teacher=teacher)
    model.train()
    kls = [k for r in rollouts for k in r.kl]
    return {
        "reward": sum(r.reward for r in rollouts) / len(rollouts),
        "exact": sum(r.exact for r in rollouts) / len(rollouts),
        "kl": sum(kls) / len(kls) if teacher is not None else None,
    }


def packed_logprobs(model: nn.Module, b: Bin) -> Tensor:
    """``[N]`` log-probs of the bin's labels through the patched model (fused head, packed layout)."""
    out = model(b.input_ids, labels=b.labels, position_ids=b.positions, return_entropy=False)
    return out.logprobs[0]


def packed_hidden(model: nn.Module, b: Bin) -> Tensor:
    """``[N, H]`` last hidden states of the bin (the backbone only: no ``N × V`` logits)."""
    return model.model(input_ids=b.input_ids, position_ids=b.positions).last_hidden_state[0]


class Policy(nn.Module):
    """The trained model's training forward, one module so that DDP wraps every path.

    ``forward(bin)`` returns :class:`~packloss.Outputs` with the ``[N]`` log-probs of the bin's labels;
    ``forward(bin, hidden=True)`` the ``[N, H]`` last hidden states and the LM-head weight ``[V, H]``
    (for the fused full-vocabulary distillation, which never builds the ``N × V`` logits).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, b: Bin, hidden: bool = False) -> Outputs:
        if hidden:
            return Outputs(hidden=packed_hidden(self.model, b), head_weight=self.model.lm_head.weight)
        return Outputs(logprobs=packed_logprobs(self.model, b))
