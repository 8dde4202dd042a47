"""packloss.vocab.sharded: the fused head on a sharded LM-head weight, on two gloo ranks against one
unsharded float64 process (a materialised log-softmax written here): FSDP2 inside the head module's
forward, FSDP2 outside it with deferred-sync gradient accumulation (verl #7427, also with a float32
``reduce_dtype``), tied embeddings under FSDP2, grad mode off, a DTensor ``Shard(0)`` vocab-parallel
head (torchtitan's ``ColwiseParallel``), and docs/sharded_head.md's program. Collectives are counted
with a dispatch mode on the c10d ops: the head weight is all-gathered at most once per call, whatever
the number of vocabulary blocks."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT
from packloss.testing import run_gloo
from packloss.vocab.head import linear_logprobs
from packloss.vocab.sharded import HeadWeight, head_weight, sharded_linear_logprobs

V, H, N, WORLD, IGNORE = 40, 8, 12, 2, -100
V_TP = 41  # uneven vocab-parallel shards: 21 + 20 rows
CHUNKS = dict(chunk_size=5, vocab_chunk_size=6)  # 3 token chunks × 7 vocabulary blocks per call
BLOCKS = 3 * 7
DOC = ROOT / "docs" / "sharded_head.md"


# ---------------------------------------------------------------------------------------------------
# The model, the data, the loss and the reference
# ---------------------------------------------------------------------------------------------------


class FusedHead(nn.Module):
    """An output layer whose forward is the fused head: the 'inside the module's forward' case."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor):
        with head_weight(self) as (w, parallel):
            return linear_logprobs(hidden, w, labels, parallel=parallel, entropy_grad=True, **CHUNKS)


class LM(nn.Module):
    """``hidden = tanh(body(embed(ids)))``; ``lm_head`` [V, H] separate, tied to ``embed`` or fused."""

    def __init__(self, tied: bool = False, fused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H, dtype=torch.float64)
        self.body = nn.Linear(H, H, dtype=torch.float64)
        self.lm_head = nn.Linear(H, V, bias=False, dtype=torch.float64)
        if tied:
            self.lm_head.weight = self.embed.weight
        if fused:
            self.lm_head = FusedHead(self.lm_head.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed(ids)))  # [N, H]


def _batch(seed: int, vocab: int = V) -> tuple[torch.Tensor, ...]:
    """``ids``, ``labels`` (every 4th ignored) ``[N]`` and the loss's coefficients ``a``, ``b`` ``[N]``."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, V, (N,), generator=g), torch.randint(0, vocab, (N,), generator=g)
    labels[::4] = IGNORE
    a, b = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    return ids, labels, a, b


def _seed(rank: int, micro: int) -> int:
    return 100 * rank + micro


def _loss(lp: torch.Tensor, ent: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * lp).sum() + (b * ent).sum()


def _dense_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """The reference head: materialised ``[N, V]`` log-softmax, plain autograd."""
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)  # [N, V]
    valid = labels != IGNORE
    lp = torch.where(valid, logp.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1), 0.0)
    return lp, -(logp.exp() * logp).sum(-1)


def _reference(tied: bool, micros: int) -> dict:
    """One process over every rank's micro-batches; FSDP averages the ranks' gradients, hence ``/ WORLD``
    (a rank's hidden states get its own loss's gradient, hence ``* WORLD`` back)."""
    model = LM(tied)
    total, hiddens = 0.0, []
    for rank in range(WORLD):
        for micro in range(micros):
            ids, labels, a, b = _batch(_seed(rank, micro))
            hidden = model(ids)
            hidden.retain_grad()
            hiddens.append(hidden)
            total = total + _loss(*_dense_head(hidden, model.lm_head.weight, labels), a, b) / WORLD
    total.backward()
    return {"grads": {n: p.grad for n, p in model.named_parameters()}, "hidden": [h.grad * WORLD for h in hiddens]}


# ---------------------------------------------------------------------------------------------------
# Counting collectives
# ---------------------------------------------------------------------------------------------------


class Collectives(TorchDispatchMode):
    """Records every c10d all-gather (eager ``c10d`` and functional ``_c10d_functional`` ops) with the
    number of elements it gathers, and counts all-reduces."""

    def __enter__(self) -> Collectives:
        self.gathers: list[int] = []
        self.all_reduces = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if "c10d" in name and ("allgather" in name or "all_gather" in name):
            if name == "c10d::_allgather_base_":
                self.gathers.append(args[0].numel())
            elif name == "_c10d_functional::all_gather_into_tensor":
                self.gathers.append(args[0].numel() * args[1])
            else:  # any other form is counted as a gather of the head
                self.gathers.append(sys.maxsize)
        elif "c10d" in name and ("allreduce" in name or "all_reduce" in name):
            self.all_reduces += 1
        return func(*args, **(kwargs or {}))

    def head_gathers(self, head_numel: int = V * H) -> int:
        """All-gathers big enough to hold the head weight (the other groups here are far smaller)."""
        return sum(n >= head_numel for n in self.gathers)


# ---------------------------------------------------------------------------------------------------
# The FSDP2 cases, each on its own model, in one gloo group
# ---------------------------------------------------------------------------------------------------


def _wrap(model: LM, case: str) -> LM:
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32) if case == "outside_mp" else MixedPrecisionPolicy()
    fully_shard(model.body, mp_policy=policy)
    if case in ("tied_unit", "no_grad_tied"):  # FSDP2 keeps tied modules in one group
        fully_shard([model.embed, model.lm_head], mp_policy=policy)
    if case in ("inside", "inside_reshard", "outside", "outside_mp", "per_chunk", "no_grad"):
        fully_shard(model.lm_head, mp_policy=policy, reshard_after_forward=case != "inside")
    return fully_shard(model, mp_policy=policy)


FSDP_CASES = {  # name: (tied, fused head module, micro-batches)
    "inside": (False, True, 1),  # head unit with reshard_after_forward=False
    "inside_reshard": (False, True, 1),  # head unit resharded after its forward: FSDP re-gathers in backward
    "outside": (False, False, 2),  # verl #7427: lm_head unit never forwarded, sync deferred on micro 0
    "outside_mp": (False, False, 2),  # the same with reduce_dtype=float32 (#7427's configuration)
    "tied_unit": (True, False, 2),  # tied to embed, its own unit, resharded after the forward
    "tied_root": (True, False, 2),  # tied, in the root group (kept unsharded after the forward)
}


def _fsdp_case(case: str) -> dict:
    tied, fused, micros = FSDP_CASES[case]
    model = _wrap(LM(tied, fused), case)
    rank = dist.get_rank()
    out: dict = {"call": [], "backward": [], "hidden": [], "types": []}
    for micro in range(micros):
        model.set_requires_gradient_sync(micro == micros - 1)
        ids, labels, a, b = _batch(_seed(rank, micro))
        hidden = model(ids)
        hidden.retain_grad()
        with Collectives() as call:
            if fused:
                lp, ent = model.lm_head(hidden, labels)
            else:
                with head_weight(model.lm_head) as (w, parallel):
                    out["types"].append((type(w).__name__, parallel))
                    lp, ent = linear_logprobs(hidden, w, labels, parallel=parallel, entropy_grad=True, **CHUNKS)
        with Collectives() as backward:
            _loss(lp, ent, a, b).backward()
        out["call"].append(call.head_gathers())
        out["backward"].append(backward.head_gathers())
        out["hidden"].append(hidden.grad)
    out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out["resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def _no_grad_case(case: str) -> dict:
    """Log-probs under ``torch.no_grad`` (old / reference log-probs): one gather, resharded on exit."""
    model = _wrap(LM(tied=case == "no_grad_tied"), case)
    ids, labels, _, _ = _batch(_seed(dist.get_rank(), 0))
    with torch.no_grad():
        hidden = model(ids)
        with Collectives() as call:
            lp, ent = sharded_linear_logprobs(hidden, model.lm_head, labels, **CHUNKS)
    return {"call": call.head_gathers(), "sharded_after": isinstance(model.lm_head.weight, DTensor), "lp": lp}


def _per_chunk_case() -> int:
    """The pattern of TRL #6077: the head module called once per token chunk gathers once per chunk."""
    model = _wrap(LM(), "per_chunk")
    hidden = model(_batch(0)[0])
    with Collectives() as calls:
        torch.cat([model.lm_head(h) for h in hidden.split(4)])
    return calls.head_gathers()


# ---------------------------------------------------------------------------------------------------
# The vocab-parallel cases (DTensor over a tensor-parallel mesh)
# ---------------------------------------------------------------------------------------------------


def _tp_head() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(H, V_TP, bias=False, dtype=torch.float64)


def _tp_inputs() -> tuple[torch.Tensor, ...]:
    """The same full hidden states on every rank of the tensor-parallel group."""
    hidden = torch.randn(N, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return (hidden.requires_grad_(), *_batch(7, vocab=V_TP)[1:])


def _tp_cases() -> dict:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    head = parallelize_module(_tp_head(), mesh, ColwiseParallel())
    hidden, labels, a, b = _tp_inputs()
    with Collectives() as call:
        with head_weight(head) as (w, parallel):
            shard = (tuple(w.shape), parallel.vocab_start, dist.get_world_size(parallel.group))
            lp, ent = linear_logprobs(hidden, w, labels, parallel=parallel, entropy_grad=True, **CHUNKS)
    with Collectives() as backward:
        _loss(lp, ent, a, b).backward()
    replicated = nn.Parameter(distribute_tensor(_tp_head().weight.detach(), mesh, [Replicate()]))
    with head_weight(replicated) as (w_rep, p_rep):
        full = (type(w_rep).__name__, tuple(w_rep.shape), p_rep)
    bad = nn.Parameter(distribute_tensor(_tp_head().weight.detach(), mesh, [Shard(1)]))
    try:
        with head_weight(bad):
            error = None
    except ValueError as e:
        error = str(e)
    return {
        "shard": shard, "lp": lp.detach(), "ent": ent.detach(), "hidden": hidden.grad,
        "weight": head.weight.grad.full_tensor(), "grad_placements": tuple(head.weight.grad.placements),
        "gathers": len(call.gathers) + len(backward.gathers), "call_all_reduces": call.all_reduces,
        "backward_all_reduces": backward.all_reduces, "replicated": full, "shard1_error": error,
    }  # fmt: skip


def _doc_step(program: str):
    namespace: dict = {}
    exec(compile(program, str(DOC), "exec"), namespace)
    return namespace["step"](), namespace["vocab_parallel_step"]()


def _worker(rank: int, world: int, program: str) -> dict:
    out = {case: _fsdp_case(case) for case in FSDP_CASES}
    out.update({case: _no_grad_case(case) for case in ("no_grad", "no_grad_tied")})
    out["per_chunk"] = _per_chunk_case()
    out["tp"] = _tp_cases()
    out["doc"] = _doc_step(program)
    return out


def _doc_program() -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S))


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_gloo(_worker, world_size=WORLD, args=(_doc_program(),), timeout=240)


# ---------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    tol = dict(rtol=1e-6, atol=1e-8) if case == "outside_mp" else dict(rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_fsdp2_gradients_equal_one_unsharded_process(ranks, case):
    tied, _, micros = FSDP_CASES[case]
    want = _reference(tied, micros)
    assert all(grad.abs().max() > 0 for grad in want["grads"].values())
    for rank, result in enumerate(ranks):
        got = result[case]
        assert set(got["grads"]) == set(want["grads"])  # tied: one Parameter, under one name
        for name, grad in want["grads"].items():
            _close(got["grads"][name], grad, case)
        for micro, grad in enumerate(got["hidden"]):
            _close(grad, want["hidden"][rank * micros + micro], case)
        assert got["resharded"], case  # FSDP's post-backward resharded the group we unsharded


# per call: head-weight all-gathers during the call, then during its backward
GATHERS = {
    "inside": ([1], [0]),  # FSDP's pre-forward; kept for the backward (reshard_after_forward=False)
    "inside_reshard": ([1], [1]),  # FSDP's own policy: resharded after the forward, re-gathered for backward
    "outside": ([1, 1], [0, 0]),  # head_weight's unshard, kept until FSDP's post-backward
    "outside_mp": ([1, 1], [0, 0]),
    "tied_unit": ([1, 1], [0, 0]),
    "tied_root": ([0, 0], [0, 0]),  # the root group is still unsharded after the forward
}


@pytest.mark.parametrize("case", list(GATHERS))
def test_the_head_weight_is_gathered_at_most_once_per_call_over_many_blocks(ranks, case):
    for result in ranks:
        assert (result[case]["call"], result[case]["backward"]) == GATHERS[case]


def test_outside_the_forward_the_head_gets_the_unsharded_parameter(ranks):
    for result in ranks:
        assert result["outside"]["types"] == [("Parameter", None)] * 2
        assert result["tied_root"]["types"] == [("Parameter", None)] * 2


def test_the_counter_sees_one_gather_per_chunk_when_the_module_is_called_per_chunk(ranks):
    for result in ranks:
        assert result["per_chunk"] == N // 4


@pytest.mark.parametrize("case", ["no_grad", "no_grad_tied"])
def test_grad_mode_off_gathers_once_and_reshards_on_exit(ranks, case):
    model = LM(tied=case == "no_grad_tied")
    for rank, result in enumerate(ranks):
        ids, labels, _, _ = _batch(_seed(rank, 0))
        with torch.no_grad():
            want, _ = _dense_head(model(ids), model.lm_head.weight, labels)
        assert result[case]["call"] == 1 and result[case]["sharded_after"]
        torch.testing.assert_close(result[case]["lp"], want, rtol=1e-12, atol=1e-12)


def test_dtensor_shard0_is_vocab_parallel_without_a_gather(ranks):
    head = _tp_head()
    hidden, labels, a, b = _tp_inputs()
    lp, ent = _dense_head(hidden, head.weight, labels)
    _loss(lp, ent, a, b).backward()
    for rank, result in enumerate(ranks):
        tp = result["tp"]
        assert tp["shard"] == (((21, H), 0) if rank == 0 else ((20, H), 21)) + (WORLD,)
        assert tp["gathers"] == 0
        # the online log-sum-exp's MAX and SUM all-reduces, whatever the number of blocks; d_hidden's SUM
        assert (tp["call_all_reduces"], tp["backward_all_reduces"]) == (2, 1)
        torch.testing.assert_close(tp["lp"], lp.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(tp["ent"], ent.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(tp["hidden"], hidden.grad, rtol=1e-11, atol=1e-13)
        torch.testing.assert_close(tp["weight"], head.weight.grad, rtol=1e-11, atol=1e-13)
        assert tp["grad_placements"] == (Shard(0),)


def test_a_replicated_dtensor_is_a_full_local_head_and_other_placements_are_refused(ranks):
    for result in ranks:
        assert result["tp"]["replicated"] == ("Tensor", (V_TP, H), None)
        assert "Shard(0)" in result["tp"]["shard1_error"] and "Shard(dim=1)" in result["tp"]["shard1_error"]


def test_the_docs_program_matches_one_process(ranks):
    namespace: dict = {}
    exec(compile(_doc_program(), str(DOC), "exec"), namespace)
    want = namespace["reference"](), namespace["vocab_parallel_reference"]()
    assert all(w.abs().max() > 0 for w in want)
    for result in ranks:
        for got, w in zip(result["doc"], want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-11, atol=1e-13)


# ---------------------------------------------------------------------------------------------------
# One process: plain weights and bad input
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_module", [False, True])
def test_a_plain_weight_is_passed_as_is(as_module):
    model = LM()
    with head_weight(model.lm_head if as_module else model.lm_head.weight) as got:
        assert isinstance(got, HeadWeight) and got.weight is model.lm_head.weight and got.parallel is None
    hidden = torch.randn(N, H, dtype=torch.float64)
    labels = _batch(3)[1]
    got = sharded_linear_logprobs(hidden, model.lm_head, labels, **CHUNKS)
    want = _dense_head(hidden, model.lm_head.weight, labels)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_tied_plain_weight_receives_both_gradients():
    ids, labels, a, b = _batch(4)
    model, ref = LM(tied=True), LM(tied=True)
    _loss(*sharded_linear_logprobs(model(ids), model.lm_head, labels, entropy_grad=True, **CHUNKS), a, b).backward()
    _loss(*_dense_head(ref(ids), ref.lm_head.weight, labels), a, b).backward()
    assert model.lm_head.weight is model.embed.weight
    torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad, rtol=1e-12, atol=1e-12)


def _partitioned() -> nn.Parameter:
    """What a ZeRO-3 parameter looks like outside a gather: no data, a ``ds_status``."""
    p = nn.Parameter(torch.empty(0))
    p.ds_status = "NOT_AVAILABLE"
    return p


@pytest.mark.parametrize(
    "head,error,match",
    [
        (nn.Linear(H, V), ValueError, "bias"),
        (nn.ReLU(), TypeError, "weight"),
        ("lm_head", TypeError, "head must be"),
        (_partitioned(), ValueError, "GatheredParameters"),
    ],
)
def test_bad_heads_are_refused_by_name(head, error, match):
    with pytest.raises(error, match=match):
        with head_weight(head):
            pass


def test_sharded_linear_logprobs_takes_no_parallel():
    with pytest.raises(TypeError, match="parallel"):
        sharded_linear_logprobs(torch.zeros(2, H), torch.zeros(V, H), torch.zeros(2, dtype=torch.long), parallel=None)
