"""packloss.integrations.common.mapping: values spelled as their constructor calls, normalisations, the
not-mapped row, and the Markdown table of mapping rows."""

from __future__ import annotations

import torch

from packloss import SFT, Component, KLPenalty, PolicyGradient
from packloss.core.trust_regions import PPOClip
from packloss.integrations.common.mapping import MappingRow, markdown, not_mapped, spell, spell_normalize


def test_spell_writes_constructor_calls_with_the_fields_that_matter():
    assert spell(0.1 + 0.2) == "0.3" and spell(1e-8) == "1e-08"  # floats to 6 significant digits
    assert spell("token") == "'token'" and spell(None) == "None"
    assert spell((KLPenalty(0.04),)) == "(KLPenalty(coef=0.04),)"  # defaults left out; a 1-tuple keeps its comma
    assert spell(KLPenalty(0.04), full=True) == "KLPenalty(coef=0.04, estimator='k3', against='ref')"
    assert spell(PPOClip()) == "PPOClip(clip_low=0.2, clip_high=0.2, dual_clip_c=None)"  # a region: every field
    pg = PolicyGradient(PPOClip(0.2, 0.28), ratio="rollout", penalties=(KLPenalty(0.001),))
    assert spell(pg) == (
        "PolicyGradient(PPOClip(clip_low=0.2, clip_high=0.28, dual_clip_c=None), ratio='rollout', "
        "penalties=(KLPenalty(coef=0.001),))"
    )


def test_spell_normalize():
    mask, weights = None, torch.ones(3)
    assert spell_normalize(Component(SFT(), mask, weights)) == "token"
    assert spell_normalize(Component(SFT(), mask, weights, "sequence_mean")) == "sequence_mean"
    assert spell_normalize(Component(SFT(), mask, weights, "constant", 4096.0)) == "constant (C = 4096)"


def test_markdown_table_of_rows():
    rows = [
        MappingRow("loss_agg_mode", "token-mean", "every component", "token", ""),
        MappingRow("policy_loss.loss_mode", "vanilla", "PolicyGradient(PPOClip(0.2))", "token", "a | b"),
        not_mapped("kl_loss_type", "full", "verl's full KL needs the logits"),
    ]
    assert rows[2] == MappingRow("kl_loss_type", "full", "not mapped (NotImplementedError)", "—",
                                 "verl's full KL needs the logits")  # fmt: skip
    assert markdown(rows, "verl option") == "\n".join(
        [
            "| verl option | value | packloss | normalisation | notes |",
            "|---|---|---|---|---|",
            "| loss_agg_mode | `token-mean` | every component | token | — |",
            "| policy_loss.loss_mode | `vanilla` | `PolicyGradient(PPOClip(0.2))` | token | a \\| b |",
            "| kl_loss_type | `full` | not mapped (NotImplementedError) | — | verl's full KL needs the logits |",
            "",
        ]
    )
