"""``packloss.compat.prime_rl`` is the README's one-import switch: every name of the #2951-era module."""

from __future__ import annotations

from packloss.compat import prime_rl
from packloss.integrations.prime_rl import legacy


def test_every_name_of_the_legacy_module_under_the_switch():
    assert prime_rl.__all__ == legacy.__all__
    assert all(getattr(prime_rl, name) is getattr(legacy, name) for name in legacy.__all__)
    assert not hasattr(prime_rl, "IcePopLossConfig")  # the current API lives in packloss.integrations.prime_rl
