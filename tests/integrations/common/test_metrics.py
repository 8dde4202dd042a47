"""packloss.integrations.common.metrics: a component's metrics without their prefix, and a peer's metric
names as sums of packloss metrics with the rest kept under a prefix."""

from __future__ import annotations

import torch

from packloss.integrations.common.metrics import component_metrics, peer_metrics


def test_component_metrics_strip_the_prefix_and_detach():
    loss = torch.tensor(0.5, requires_grad=True) * 2
    metrics = {"pg/loss": loss, "pg/is_masked": torch.tensor(0.25), "pgx/loss": torch.tensor(9.0),
               "kl/ref_kl_penalty": torch.tensor(0.1)}  # fmt: skip
    got = component_metrics(metrics, "pg")
    assert set(got) == {"loss", "is_masked"}  # "pgx/" is another component
    assert got["loss"].item() == 1.0 and not got["loss"].requires_grad
    assert component_metrics(metrics, "entropy") == {}


def test_peer_metrics_sum_their_sources_and_keep_the_rest_under_a_prefix():
    own = {"clip_frac_low": torch.tensor(0.1), "clip_frac_high": torch.tensor(0.25), "is_masked": torch.tensor(0.5)}
    table = {
        "pg_clipfrac": ("clip_frac_low", "clip_frac_high"),  # the sum of both
        "pg_masked": ("is_masked",),
        "dual_clipfrac": ("dual_clip_frac",),  # a source packloss did not report: no peer metric
        "pg_clipfrac_lower": (),  # the peer reports a constant 0
    }
    got = peer_metrics(own, table)
    assert set(got) == {"pg_clipfrac", "pg_masked", "pg_clipfrac_lower"}
    assert got["pg_clipfrac_lower"].item() == 0.0 and got["pg_clipfrac_lower"].dim() == 0
    assert got["pg_clipfrac"].item() == torch.tensor(0.35).item() and got["pg_masked"] is own["is_masked"]
    with_rest = peer_metrics(own, table, rest="packloss/")
    assert set(with_rest) == {"pg_clipfrac", "pg_masked", "pg_clipfrac_lower", "packloss/clip_frac_low",
                              "packloss/clip_frac_high", "packloss/is_masked"}  # fmt: skip
    assert with_rest["packloss/clip_frac_high"] is own["clip_frac_high"]
