"""``VocabDistill``: full-vocabulary distillation as a component of the packed-bin loss engine.

With the component's members ``m``, weights ``w``, divisor ``d`` and denominator ``D`` (its
:class:`~packloss.core.bin.Aggregation`), the term is

    term = Σ_t m_t · w_t · L_t / d_t / D

with ``L_t`` the divergence of :func:`~packloss.vocab.distill.divergence`. Two paths, the same term:

* **logits** (``Outputs(logits=s)``): ``L [N]`` from :func:`~packloss.vocab.distill.divergence`; the
  engine reduces it, and the gradient flows through its row-scaled backward (one ``[N, V]`` buffer).
* **hidden states** (``Outputs(hidden=h, head_weight=W)``): fused, :func:`~packloss.vocab.head_distill.linear_distill`
  with the coefficients ``m·w/(d·D)``; the ``N × V`` logits never exist and the component returns the
  term itself (``ComponentOutput.loss``).

The teacher is the plan's ``teacher_logits [N, V]`` or its head ``teacher_hidden [N, H_t]`` +
``teacher_weight [V, H_t]`` (the latter with the hidden-state path only).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import compute_dtype
from packloss.vocab.core import (
    IMPLS,
    DivergenceSpec,
    Impl,
    TeacherFormat,
    VocabParallel,
    check_parallel,
    check_positive_int,
)
from packloss.vocab.distill import divergence
from packloss.vocab.head_distill import linear_distill

__all__ = ["VocabDistill"]


@dataclass(frozen=True)
class VocabDistill(Objective):
    """Full-vocabulary distillation component: ``ℓ_t = L_t``, the divergence ``kind`` between
    ``q = softmax(s_t / temperature)`` and ``p = softmax(t_t / teacher_temperature)``.

    Args:
        kind: ``"reverse_kl"``, ``"forward_kl"``, ``"soft_cross_entropy"``, ``"jsd"`` (any key of
            :data:`~packloss.vocab.core.DIVERGENCES`).
        beta: ``β`` of JSD in [0, 1].
        temperature, teacher_temperature: finite and > 0.
        teacher_format: of the plan's ``teacher_logits``: ``"logits"``, ``"logprobs"`` or ``"probs"``.
        chunk_size: tokens per chunk (None: :func:`~packloss.vocab.core.chunk_rows`).
        impl: ``"eager"``, ``"compiled"`` or None (the device's default).
        parallel: :class:`~packloss.vocab.core.VocabParallel` when the logits / head weight / teacher
            are this rank's vocabulary shard.

    Metric ``{kind}``: the mean divergence over the members.
    """

    kind: str = "reverse_kl"
    beta: float = 0.5
    temperature: float = 1.0
    teacher_temperature: float = 1.0
    teacher_format: TeacherFormat = "logits"
    chunk_size: int | None = None
    impl: Impl | None = None
    parallel: VocabParallel | None = None

    def __post_init__(self) -> None:
        spec = DivergenceSpec(self.kind, self.beta, self.temperature, self.teacher_temperature, self.teacher_format)
        object.__setattr__(self, "beta", spec.beta)
        object.__setattr__(self, "temperature", spec.temperature)
        object.__setattr__(self, "teacher_temperature", spec.teacher_temperature)
        if self.chunk_size is not None:
            check_positive_int("chunk_size", self.chunk_size)
        if self.impl not in (None, *IMPLS):
            raise ValueError(f"impl must be one of {IMPLS} or None, got {self.impl!r}")
        check_parallel(self.parallel)

    def check_plan(self, plan: Plan, name: str) -> None:
        """Raise a ``ValueError`` naming the component unless the plan carries a teacher."""
        if plan.teacher_logits is None and plan.teacher_hidden is None:
            raise ValueError(
                f"component {name!r} (VocabDistill) needs the plan's teacher_logits or teacher_hidden + teacher_weight"
            )

    def _options(self) -> dict:
        return dict(
            beta=self.beta, temperature=self.temperature, teacher_temperature=self.teacher_temperature,
            teacher_format=self.teacher_format, chunk_size=self.chunk_size, impl=self.impl, parallel=self.parallel,
        )  # fmt: skip

    def _output(self, inputs: ComponentInputs, per_token: Tensor, loss: Tensor | None = None) -> ComponentOutput:
        value, count = inputs.mean(per_token, inputs.loss_mask)
        return ComponentOutput(per_token=per_token, metrics={self.kind: value}, counts={self.kind: count}, loss=loss)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        plan, outputs, name, mask = inputs.plan, inputs.outputs, inputs.name, inputs.loss_mask
        if outputs.logits is not None:
            if plan.teacher_logits is None:
                raise ValueError(
                    f"component {name!r} (VocabDistill): the plan's teacher_hidden needs outputs.hidden and "
                    "outputs.head_weight (the logits path takes teacher_logits)"
                )
            per_token = divergence(self.kind, outputs.logits, plan.teacher_logits, mask, **self._options())  # [N]
            return self._output(inputs, per_token)
        if outputs.hidden is not None:
            h, w = outputs.hidden, outputs.head_weight  # [N, H], [V, H]
            coefficients = inputs.aggregation.coefficients(compute_dtype(h.dtype, w.dtype))  # [N], 0 off members
            loss, per_token = linear_distill(
                h, w, plan.teacher_logits, teacher_hidden=plan.teacher_hidden, teacher_weight=plan.teacher_weight,
                kind=self.kind, loss_mask=mask, coefficients=coefficients, **self._options(),
            )  # fmt: skip
            return self._output(inputs, per_token, loss)
        raise ValueError(
            f"component {name!r} (VocabDistill) needs outputs.logits, or outputs.hidden and outputs.head_weight"
        )
