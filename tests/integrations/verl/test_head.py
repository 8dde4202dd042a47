"""packloss.integrations.verl.head: ``impl_backend=packloss`` as verl 0.9.1's fused-kernel backend, against
verl's own ``torch`` backend (``FusedLinearForPPO``) and verl's own code around it: log-probs, entropy and
their gradients in float32 and bfloat16 (bfloat16 also against a float64 reference), 2-D and 3-D inputs,
temperature ≠ 1; a tiny Qwen2 through ``apply_monkey_patch`` and through the FSDP engine's model build from
an OmegaConf ``HFModelConfig`` (config alone); the hooks' refusals (verl's, for unknown names); no ``N × V``
tensor and no sync on packloss's path; verl's ``tests/utils/test_linear_cross_entropy.py`` from a verl
checkout (``PACKLOSS_VERL_SOURCE``, by default the local mirror; skipped without one) on CPU."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import verl  # noqa: F401 - loads the verl.plugins entry points, packloss's among them
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers import monkey_patch
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.experimental.torch_functional import FusedLinearForPPO
from verl.workers.config import HFModelConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from packloss.integrations.verl import plugin
from packloss.integrations.verl.head import BACKEND, fused_linear_for_ppo, install, installed, uninstall
from packloss.testing import OpCounter
from tests.vocab.harness import MaxNumel

INSTALLED_BY_IMPORT = installed()  # read at collection, before any test installs or uninstalls
F64 = torch.float64
VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on CI's two shared cores a second one mostly waits (10× slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def verl_patching(monkeypatch):
    """Room for verl's ``apply_monkey_patch``: ``Qwen2ForCausalLM.forward`` (which verl replaces on the class)
    restored afterwards, and verl's TRL step skipped (verl 0.9.1 imports ``AutoModelForCausalLMWithValueHead``,
    which TRL 1.16 no longer has, so with TRL installed ``apply_monkey_patch`` fails whatever the backend)."""
    monkeypatch.setattr(Qwen2ForCausalLM, "forward", Qwen2ForCausalLM.forward)
    monkeypatch.setattr(monkey_patch, "is_trl_available", lambda: False)
    install()
    yield
    install()


# ---------------------------------------------------------------------------------------------------
# The backend against verl's torch backend
# ---------------------------------------------------------------------------------------------------


def head_case(shape: tuple[int, ...], h: int, v: int, dtype: torch.dtype, seed: int):
    """``hidden [*shape, H]``, ``weight [V, H]``, labels ``[*shape]``, and upstream gradients for both outputs
    (exact in bfloat16, so every path receives the same ones)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, v, shape, generator=g)
    grads = tuple(torch.randn(shape, generator=g).bfloat16().to(F64) for _ in range(2))
    return hidden, weight, labels, grads


def run_backend(backend: str, hidden, weight, labels, temperature, grads, entropy_used: bool = True):
    """``FusedLinearForPPO(impl_backend=backend)`` as verl's model forwards call it, then the gradients of
    ``Σ g_lp·log_prob (+ Σ g_ent·entropy)`` with respect to ``hidden`` and ``weight``."""
    log_probs, entropy = FusedLinearForPPO(impl_backend=backend).forward(
        hidden_states=hidden, vocab_weights=weight, input_ids=labels, temperature=temperature
    )
    loss = (log_probs * grads[0].to(log_probs.dtype)).sum()
    if entropy_used:
        loss = loss + (entropy * grads[1].to(entropy.dtype)).sum()
    return (log_probs, entropy, *torch.autograd.grad(loss, (hidden, weight)))


def float64_reference(hidden, weight, labels, temperature, grads):
    """Log-probs, entropy and both gradients from the full ``[N, V]`` logits in float64 (written here)."""
    h, w = hidden.detach().to(F64).requires_grad_(), weight.detach().to(F64).requires_grad_()
    x = h @ w.T / temperature
    log_p = x.log_softmax(-1)
    log_probs = log_p.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    loss = (log_probs * grads[0]).sum() + (entropy * grads[1]).sum()
    return (log_probs, entropy, *torch.autograd.grad(loss, (h, w)))


def max_error(got, want) -> float:
    """``max |got − want| / max |want|``."""
    return ((got.to(F64) - want.to(F64)).abs().max() / want.to(F64).abs().max()).item()


SHAPES = [((7,), 16, 33), ((1300,), 40, 2600), ((2, 650), 24, 1500), ((1, 97), 8, 5000)]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: f"{c[0]}x{c[1]}-V{c[2]}")
def test_float32_equals_verls_torch_backend(case, temperature):
    shape, h, v = case
    hidden, weight, labels, grads = head_case(shape, h, v, torch.float32, seed=len(shape) * v)
    want = run_backend("torch", hidden, weight, labels, temperature, grads)
    got = run_backend(BACKEND, hidden, weight, labels, temperature, grads)
    for name, a, b in zip(("log_probs", "entropy", "d_hidden", "d_weight"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6 * b.abs().max().item(), msg=name)


@pytest.mark.parametrize("case", SHAPES[1:], ids=lambda c: f"{c[0]}x{c[1]}-V{c[2]}")
def test_bfloat16_is_verls_torch_backend_or_closer_to_float64(case):
    """verl rounds the logits to bfloat16 before its float32 softmax; packloss computes them in float32, so
    against the float64 reference it is within bfloat16 rounding of its outputs and never worse than verl."""
    shape, h, v = case
    hidden, weight, labels, grads = head_case(shape, h, v, torch.bfloat16, seed=v)
    verl_out = run_backend("torch", hidden, weight, labels, 0.7, grads)
    got = run_backend(BACKEND, hidden, weight, labels, 0.7, grads)
    ref = float64_reference(hidden, weight, labels, 0.7, grads)
    for name, a, b, r in zip(("log_probs", "entropy", "d_hidden", "d_weight"), got, verl_out, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert max_error(a, r) <= max_error(b, r), name
        assert max_error(a, r) < (1e-5 if name == "log_probs" else 6e-3), name  # float32 / a bfloat16 result
        assert max_error(a, b) < 6e-2, name


def test_entropy_unused_and_log_probs_unused():
    """verl's loss may use only the log-probs (entropy_coeff = 0) or only the entropy: the same gradients."""
    hidden, weight, labels, grads = head_case((300,), 16, 1100, torch.float32, seed=3)
    for used in (False, True):
        want = run_backend("torch", hidden, weight, labels, 0.9, grads, entropy_used=used)
        got = run_backend(BACKEND, hidden, weight, labels, 0.9, grads, entropy_used=used)
        for a, b in zip(got[2:], want[2:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6 * b.abs().max().item())
    zero_lp = (torch.zeros_like(grads[0]), grads[1])
    want = run_backend("torch", hidden, weight, labels, 0.9, zero_lp)
    got = run_backend(BACKEND, hidden, weight, labels, 0.9, zero_lp)
    for a, b in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6 * b.abs().max().item())


def test_tensor_temperature_broadcasts_to_the_labels():
    """A per-row temperature ``[B, 1]`` gives each row what the row's float gives (verl #6110's request)."""
    hidden, weight, labels, _ = head_case((2, 40), 16, 700, torch.float32, seed=5)
    temps = (0.6, 1.4)
    log_probs, entropy = fused_linear_for_ppo(hidden, weight, labels, torch.tensor([[temps[0]], [temps[1]]]))
    for row, t in enumerate(temps):
        want = FusedLinearForPPO().forward(hidden[row], weight, labels[row], temperature=t)
        torch.testing.assert_close(log_probs[row], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[row], want[1], rtol=1e-5, atol=1e-5)


def test_never_an_n_by_v_tensor_and_no_sync():
    """N = 600, V = 4096: at most one vocabulary block of 1024 columns (a quarter of the logits) on
    packloss's path, forward and backward, without a device→host sync; verl's torch backend makes a
    ``512 × V`` chunk of logits."""
    n, v = 600, 4096
    hidden, weight, labels, grads = head_case((n,), 16, v, torch.float32, seed=7)
    with MaxNumel() as sizes, OpCounter() as ops:
        run_backend(BACKEND, hidden, weight, labels, 0.8, grads)
    assert sizes.max_numel <= n * v // 4, sizes.max_numel
    assert ops.num_syncs == 0, ops.syncs
    with MaxNumel() as sizes:
        run_backend("torch", hidden, weight, labels, 0.8, grads)
    assert sizes.max_numel >= 512 * v


# ---------------------------------------------------------------------------------------------------
# The hooks
# ---------------------------------------------------------------------------------------------------


def test_import_verl_installs_the_backend(caplog, monkeypatch):
    """The plugin (loaded by ``import verl``) installed the hooks; its entry-point work installs them again
    after an uninstall, and a failing install only warns."""
    assert INSTALLED_BY_IMPORT
    try:
        uninstall()
        assert not installed()
        plugin._register_on_import()
        assert installed()
    finally:
        install()

    def failing() -> None:
        raise ImportError("no verl here")

    monkeypatch.setattr(plugin, "install_head", failing)
    with caplog.at_level(logging.WARNING):
        plugin._register_on_import()
    assert "could not install its fused-kernel backend in verl (ImportError: no verl here)" in caplog.text


def test_install_is_idempotent_and_uninstall_restores_verl():
    install()
    install()
    init = FusedLinearForPPO.__init__
    assert not hasattr(init._packloss_original, "_packloss_original")  # wrapped once
    try:
        uninstall()
        uninstall()
        assert FusedLinearForPPO.__init__ is init._packloss_original
        with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend: packloss"):
            FusedLinearForPPO(impl_backend=BACKEND)
    finally:
        install()
    assert FusedLinearForPPO(impl_backend=BACKEND).impl_backend == BACKEND


def test_verls_own_refusals_stay(verl_patching):
    """Unknown names get verl's answer: ``FusedLinearForPPO`` raises, ``patch_forward_with_backends`` skips
    (the model keeps its forward); ``packloss`` without ``use_fused_kernels`` skips as well."""
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend: nope. Choose 'torch' or 'liger'"):
        FusedLinearForPPO(impl_backend="nope")
    assert FusedLinearForPPO(512, "torch").impl_backend == "torch"
    model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    forward = Qwen2ForCausalLM.forward
    for use, backend in ((True, "nope"), (False, BACKEND), (True, None)):
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=use, fused_kernels_backend=backend)
        assert Qwen2ForCausalLM.forward is forward and not hasattr(model, "_verl_fused_kernels_backend")


def test_bad_inputs_name_the_argument():
    hidden, weight, labels, _ = head_case((2, 5), 8, 20, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"hidden_states must be a \[N, H\] or \[B, T, H\] tensor"):
        fused_linear_for_ppo(hidden[None], weight, labels)
    with pytest.raises(ValueError, match=r"input_ids must have hidden_states' leading shape \(2, 5\), got \(10,\)"):
        fused_linear_for_ppo(hidden, weight, labels.reshape(-1))
    with pytest.raises(ValueError, match="temperature must be a number or a tensor that broadcasts"):
        fused_linear_for_ppo(hidden, weight, labels, torch.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_for_ppo(hidden, weight, labels, 0.0)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        fused_linear_for_ppo(hidden, weight, labels.float())


# ---------------------------------------------------------------------------------------------------
# Models: apply_monkey_patch, and the FSDP engine's build from the config alone
# ---------------------------------------------------------------------------------------------------


def forward_and_grads(model, input_ids, **kwargs):
    out = model(input_ids=input_ids, temperature=0.8, return_dict=True, **kwargs)
    g = torch.Generator().manual_seed(1)
    loss = (out.log_probs * torch.randn(out.log_probs.shape, generator=g)).sum()
    loss = loss + (out.entropy * torch.randn(out.entropy.shape, generator=g)).sum()
    loss.backward()
    return out.log_probs, out.entropy, {k: p.grad for k, p in model.named_parameters()}


def assert_same_model_outputs(got, want):
    for a, b in zip(got[:2], want[:2], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("labels", ["rolled", "shift_labels"])
def test_apply_monkey_patch_packloss_equals_torch(verl_patching, labels):
    """verl's forward with ``FusedLinearForPPO`` on a tiny Qwen2: ``[B, T]`` input ids (verl rolls them) or
    the engine's remove-padding call (``[1, nnz]`` with ``shift_labels``)."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    kwargs = {}
    if labels == "shift_labels":
        ids = ids.reshape(1, -1)
        kwargs = dict(shift_labels=torch.roll(ids, -1, dims=-1), position_ids=torch.arange(9).repeat(2)[None])
    outputs = {}
    for backend in ("torch", BACKEND):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, attn_implementation="eager"))
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend=backend)
        assert model._verl_fused_kernels_backend == backend
        outputs[backend] = forward_and_grads(model, ids, **kwargs)
    assert_same_model_outputs(outputs[BACKEND], outputs["torch"])


def engine_model(path: Path, backend: str) -> torch.nn.Module:
    """What verl's FSDP engine builds (``FSDPEngine._build_module``: load, ``apply_monkey_patch`` from
    ``model.fused_kernel_options``) for the command-line overrides of ``actor_rollout_ref.model``."""
    overrides = ["use_fused_kernels=True", f"fused_kernel_options.impl_backend={backend}"]
    config = OmegaConf.merge(
        OmegaConf.create({"path": str(path), "load_tokenizer": False,
                          "override_config": {"attn_implementation": "eager"}}),
        OmegaConf.from_dotlist(overrides),
    )  # fmt: skip
    model_config = omega_conf_to_dataclass(config, HFModelConfig)
    assert model_config.fused_kernel_options["impl_backend"] == backend
    engine = types.SimpleNamespace(
        model_config=model_config,
        engine_config=types.SimpleNamespace(model_dtype="fp32", forward_only=False),
        device_mesh=None,
        use_remove_padding=False,
        ulysses_sequence_parallel_size=1,
    )
    return FSDPEngine._build_module(engine)


def test_config_alone_selects_packloss_in_verls_engine(verl_patching, tmp_path):
    """``use_fused_kernels=True fused_kernel_options.impl_backend=packloss`` in verl's ``HFModelConfig``
    (OmegaConf → dataclass, as the trainer builds it) gives, through the FSDP engine's own model build, a
    model whose log-probs, entropy and parameter gradients are the ``torch`` backend's (tied embeddings)."""
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    outputs = {}
    for backend in ("torch", BACKEND):
        model = engine_model(tmp_path, backend)
        assert model._verl_fused_kernels_backend == backend
        outputs[backend] = forward_and_grads(model, ids)
    assert_same_model_outputs(outputs[BACKEND], outputs["torch"])


# ---------------------------------------------------------------------------------------------------
# verl's own fused-kernel test module, from a verl checkout
# ---------------------------------------------------------------------------------------------------

VERL_SOURCE = Path(os.environ.get("PACKLOSS_VERL_SOURCE", "/work/.mirror/volcengine+verl/repo"))
VERL_TEST = "tests/utils/test_linear_cross_entropy.py"


def verl_test_source() -> str | None:
    """The text of verl's test from a work tree or a bare git repository at ``VERL_SOURCE``, or None."""
    if (VERL_SOURCE / VERL_TEST).is_file():
        return (VERL_SOURCE / VERL_TEST).read_text()
    if not (VERL_SOURCE / "HEAD").is_file():
        return None
    cmd = ["git", "--git-dir", str(VERL_SOURCE), "show", f"HEAD:{VERL_TEST}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def test_verls_linear_cross_entropy_module_on_packloss():
    """verl's module with its ``fused_linear_for_ppo`` (the "to be tested" path) swapped for
    ``FusedLinearForPPO(impl_backend="packloss")``, on CPU: its three CPU functions on inputs drawn as its
    ``generate_*_inputs`` draws them (bfloat16, [1, N, H], its temperature 1.5), with its assertions on the
    fused path. Its ``TestLinearCrossEntropy`` itself needs CUDA and its triton kernel; ``torch.compile``
    is off here (the stance), as compiling on CPU takes longer than this whole file."""
    source = verl_test_source()
    if source is None:
        pytest.skip(f"no verl checkout with {VERL_TEST} at {VERL_SOURCE} (set PACKLOSS_VERL_SOURCE)")
    module = types.ModuleType("verl_test_linear_cross_entropy")
    exec(compile(source, f"{VERL_SOURCE}/{VERL_TEST}", "exec"), module.__dict__)
    module.fused_linear_for_ppo = FusedLinearForPPO(impl_backend=BACKEND)
    g = torch.Generator().manual_seed(0)
    n, h, v, t = 257, 64, 3000, 1.5
    hidden = torch.empty(1, n, h, dtype=torch.bfloat16).uniform_(-0.5, 0.5, generator=g).requires_grad_()
    weight = torch.empty(v, h, dtype=torch.bfloat16).uniform_(-0.5, 0.5, generator=g).requires_grad_()
    labels = torch.randint(0, v, (1, n), generator=g)
    g_entropy = torch.empty(n, dtype=torch.bfloat16).uniform_(-0.5, 0.5, generator=g)
    g_logprobs = torch.empty(n, dtype=torch.bfloat16).uniform_(-1, 1, generator=g)
    with torch.compiler.set_stance("force_eager"):
        torch_out = module.run_torch_entropy(hidden, weight, labels, t)
        verl_out = module.run_verl_original_entropy(hidden, weight, labels[0], t)  # its gather wants [N] on CPU
        fused_out = module.run_verl_torch_fused_entropy(hidden, weight, labels, t)
    for want in (torch_out, verl_out):
        for a, b in zip(want, fused_out, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    fused_grads = torch.autograd.grad(fused_out[::-1], (hidden, weight), (g_entropy, g_logprobs))
    for want in (torch_out, verl_out):
        grads = torch.autograd.grad(want[::-1], (hidden, weight), (g_entropy, g_logprobs))
        for a, b in zip(grads, fused_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-4)


def test_a_fresh_interpreter_needs_only_import_verl(tmp_path):
    """After ``pip install packloss[verl]``, nothing but ``import verl`` (the entry point) makes
    ``impl_backend="packloss"`` a backend."""
    code = (
        "import sys, verl\n"
        "from verl.utils.experimental.torch_functional import FusedLinearForPPO\n"
        "m = FusedLinearForPPO(impl_backend='packloss')\n"
        "print(m.impl_backend, hasattr(type(m).forward, '_packloss_original'))\n"
    )
    environ = {k: val for k, val in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environ, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [BACKEND, "True"]
