"""OpenRLHF on packloss: a drop-in for ``openrlhf.models.loss.PolicyLoss`` (:mod:`.loss`), swapped in
where OpenRLHF's actor builds its loss. ``docs/integrations/openrlhf.md``."""

from packloss.integrations.openrlhf.loss import OPENRLHF_VERSION, PolicyLoss, aggregate_component, policy_gradient

__all__ = ["OPENRLHF_VERSION", "PolicyLoss", "policy_gradient", "aggregate_component"]
