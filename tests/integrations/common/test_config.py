"""packloss.integrations.common.config: ConfigReader over a dict, a dataclass, a SimpleNamespace and an
OmegaConf DictConfig (``???`` reads as absent): defaults, typed reads, nested sections, overrides, the
declared options, and errors that name ``where.key``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from packloss.integrations.common.config import ConfigReader, option_names

omegaconf = pytest.importorskip("omegaconf")


@dataclasses.dataclass
class _Actor:
    clip_ratio: float = 0.2
    loss_mode: str = "vanilla"
    use_kl: bool = False
    epochs: int = 1
    policy_loss: dict = dataclasses.field(default_factory=lambda: {"clip_cov_ratio": 0.0002})


FIELDS = {"clip_ratio": 0.2, "loss_mode": "vanilla", "use_kl": False, "epochs": 1,
          "policy_loss": {"clip_cov_ratio": 0.0002}}  # fmt: skip

KINDS = {
    "dict": lambda: dict(FIELDS),
    "dataclass": lambda: _Actor(),
    "namespace": lambda: SimpleNamespace(**FIELDS),
    "omegaconf": lambda: omegaconf.OmegaConf.create(FIELDS),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_of_config_reads_the_same(kind):
    r = ConfigReader(KINDS[kind](), "actor")
    assert r.number("clip_ratio") == 0.2 and r.positive("clip_ratio") == 0.2 and r.nonnegative("clip_ratio") == 0.2
    assert r.choice("loss_mode", ("vanilla", "gspo")) == "vanilla"
    assert r.flag("use_kl") is False and r.integer("epochs", minimum=1) == 1
    assert r.has("clip_ratio") and not r.has("clip_ratio_c")
    section = r.section("policy_loss")
    assert section.where == "actor.policy_loss" and section.number("clip_cov_ratio") == 0.0002
    assert r.declared() == set(FIELDS)
    assert r.get("clip_ratio_c", 3.0) == 3.0  # a missing option takes the call's default


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_errors_name_the_option_as_the_user_wrote_it(kind):
    r = ConfigReader(KINDS[kind](), "actor")
    with pytest.raises(ValueError, match=r"^actor\.clip_ratio_c is missing from the config$"):
        r.get("clip_ratio_c")
    with pytest.raises(ValueError, match=r"actor\.loss_mode must be one of \('gspo',\), got 'vanilla'"):
        r.choice("loss_mode", ("gspo",))
    with pytest.raises(TypeError, match=r"actor\.loss_mode must be a number, got str"):
        r.number("loss_mode")
    with pytest.raises(TypeError, match=r"actor\.clip_ratio must be a bool"):
        r.flag("clip_ratio")
    with pytest.raises(ValueError, match=r"actor\.epochs must be >= 2, got 1"):
        r.integer("epochs", minimum=2)
    with pytest.raises(ValueError, match=r"actor\.policy_loss\.kl_cov_ratio is missing"):
        r.section("policy_loss").number("kl_cov_ratio")


def test_omegaconf_mandatory_values_read_as_absent():
    cfg = omegaconf.OmegaConf.create({"clip_ratio": "???", "inner": {"tau": "???"}, "epochs": 3})
    r = ConfigReader(cfg, "actor_rollout_ref.actor", defaults={"clip_ratio": 0.2})
    assert not r.has("clip_ratio") and r.number("clip_ratio") == 0.2  # the peer's default
    assert r.integer("epochs") == 3
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.inner\.tau is missing from the config"):
        r.section("inner").number("tau")
    typed = omegaconf.OmegaConf.structured(_Actor)
    typed.clip_ratio = omegaconf.MISSING
    assert ConfigReader(typed, "actor").number("clip_ratio", 0.3) == 0.3


def test_defaults_overrides_and_precedence():
    r = ConfigReader({"epsilon": 0.1, "beta": None}, "GRPOConfig", defaults={"epsilon": 0.5, "delta": 2.0})
    assert r.get("epsilon") == 0.1  # the config wins over the peer's default
    assert r.get("delta") == 2.0 and r.get("delta", 4.0) == 4.0  # a call's default wins over the peer's
    assert not r.has("delta")  # defaults do not count as set
    assert r.number("beta", optional=True) is None
    with pytest.raises(TypeError, match=r"GRPOConfig\.beta must be a number, got NoneType"):
        r.number("beta")
    over = r.with_overrides(epsilon=0.3, gamma=1.0)
    assert over.get("epsilon") == 0.3 and over.has("gamma") and r.get("epsilon") == 0.1  # r is unchanged
    nested = ConfigReader({"x": 1}, "GRPOConfig.inner")
    assert r.with_overrides(inner=nested).section("inner") is nested
    assert r.section("absent").where == "GRPOConfig.absent" and r.section("beta").declared() == set()


@pytest.mark.parametrize("bad", [None, "config.yaml", 3, 0.5, True])
def test_a_config_must_be_an_object_or_a_mapping(bad):
    with pytest.raises(TypeError, match="GRPOConfig must be a config object or a mapping"):
        ConfigReader(bad, "GRPOConfig")


def test_declared_options_of_classes_that_define_them_on_the_class():
    class Plain:
        clip_ratio = 0.2  # a class attribute: the reader cannot tell what the instances declare

    instance = SimpleNamespace(a=1)
    assert ConfigReader(instance, "x").declared() == {"a"}
    assert ConfigReader(Plain(), "x").declared() == set()  # an empty __dict__
    assert ConfigReader(Plain(), "x").get("clip_ratio") == 0.2
    assert ConfigReader((1, 2), "x").declared() is None  # no __dict__: it cannot tell
    assert not ConfigReader((1, 2), "x").has("a")


def test_option_names_renames_the_fields_an_error_names_and_keeps_its_type():
    names = {"PPOClip.dual_clip_c": "actor_config.clip_ratio_c"}
    with pytest.raises(ValueError, match=r"^actor_config\.clip_ratio_c must be > 1, got 0\.5$"):
        with option_names(names):
            raise ValueError("PPOClip.dual_clip_c must be > 1, got 0.5")
    with pytest.raises(TypeError, match=r"^actor_config\.clip_ratio_c must be a number"):
        with option_names(names):
            raise TypeError("PPOClip.dual_clip_c must be a number")
    with pytest.raises(ValueError, match=r"^SAPO\.tau_pos must be > 0$"):  # not in the table: unchanged
        with option_names(names):
            raise ValueError("SAPO.tau_pos must be > 0")
