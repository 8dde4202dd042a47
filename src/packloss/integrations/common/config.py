"""Reading a peer's config: one reader for dataclasses, namespaces, pydantic models, dicts and
OmegaConf ``DictConfig``s. A missing option takes its default; every error names the option as the
user wrote it (``actor_config.clip_ratio_c``), never a packloss field."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from packloss.core import checks

__all__ = ["ConfigReader", "MISSING", "option_names"]

MISSING: Any = object()
"""The marker of an option the config does not set (and that has no default)."""
_FIELD = re.compile(r"\b[A-Z]\w*\.\w+\b")  # how core errors name a field: PPOClip.dual_clip_c


@contextlib.contextmanager
def option_names(names: Mapping[str, str]) -> Iterator[None]:
    """Within it, an error that names a packloss field (``PPOClip.dual_clip_c``) is raised again, of the
    same type, naming the peer's option instead (``names["PPOClip.dual_clip_c"]``)."""
    try:
        yield
    except (TypeError, ValueError) as error:
        message = _FIELD.sub(lambda m: names.get(m.group(0), m.group(0)), str(error))
        if message == str(error):
            raise
        raise type(error)(message) from error


class ConfigReader:
    """Reads the options of ``config`` (``where`` names it in errors, e.g. ``"GRPOConfig"``).

    ``defaults`` are the peer's defaults for options the config may lack; a default given to a call
    wins over them. ``overrides`` win over the config (:meth:`with_overrides`). An OmegaConf mandatory
    value (``???``) reads as absent.
    """

    def __init__(
        self,
        config: Any,
        where: str,
        defaults: Mapping[str, Any] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        if config is None or isinstance(config, str | bytes | int | float | bool):
            raise TypeError(f"{where} must be a config object or a mapping, got {config!r}")
        self.config = config
        self.where = where
        self.defaults = dict(defaults or {})
        self.overrides = dict(overrides or {})

    def with_overrides(self, **changes: Any) -> ConfigReader:
        """This config read with ``changes`` in place of its own options (a value may be a reader, for
        a nested config)."""
        return ConfigReader(self.config, self.where, self.defaults, {**self.overrides, **changes})

    def _raw(self, key: str) -> Any:
        if key in self.overrides:
            return self.overrides[key]
        cfg = self.config
        if isinstance(cfg, Mapping) and not dataclasses.is_dataclass(cfg):
            return cfg[key] if key in cfg else MISSING
        try:
            return getattr(cfg, key, MISSING)
        except Exception:  # noqa: BLE001 - e.g. OmegaConf's MissingMandatoryValue on attribute access
            return MISSING

    def has(self, key: str) -> bool:
        """Whether the config itself sets ``key`` (defaults do not count)."""
        return self._raw(key) is not MISSING

    def get(self, key: str, default: Any = MISSING) -> Any:
        """The option's value, else ``default``, else the peer's default, else a ``ValueError``."""
        value = self._raw(key)
        if value is MISSING:
            value = default if default is not MISSING else self.defaults.get(key, MISSING)
        if value is MISSING:
            raise ValueError(f"{self.where}.{key} is missing from the config")
        return value

    def name(self, key: str) -> str:
        """How errors name option ``key``."""
        return f"{self.where}.{key}"

    def number(self, key: str, default: Any = MISSING, *, optional: bool = False) -> float | None:
        """A finite number (None is allowed, and returned, only when ``optional``)."""
        value = self.get(key, default)
        if value is None and optional:
            return None
        return checks.number(self.name(key), value)

    def positive(self, key: str, default: Any = MISSING) -> float:
        return checks.positive(self.name(key), self.get(key, default))

    def nonnegative(self, key: str, default: Any = MISSING) -> float:
        return checks.nonnegative(self.name(key), self.get(key, default))

    def integer(self, key: str, default: Any = MISSING, *, minimum: int | None = None) -> int:
        return checks.integer(self.name(key), self.get(key, default), minimum=minimum)

    def choice(self, key: str, allowed: Collection[str], default: Any = MISSING) -> str:
        return checks.choice(self.name(key), self.get(key, default), allowed)

    def flag(self, key: str, default: Any = MISSING) -> bool:
        return checks.flag(self.name(key), self.get(key, default))

    def section(self, key: str, defaults: Mapping[str, Any] | None = None) -> ConfigReader:
        """The nested config ``key`` (an empty one when absent or None)."""
        value = self.get(key, None)
        if isinstance(value, ConfigReader):
            return value
        return ConfigReader({} if value is None else value, self.name(key), defaults)

    def declared(self) -> set[str] | None:
        """The option names the config declares (pydantic v2/v1 models, dataclasses, mappings, plain
        instances); None when it cannot tell (attributes defined on its class)."""
        cfg = self.config
        for attr in ("model_fields", "__fields__"):  # pydantic v2, v1: read on the class
            declared = getattr(type(cfg), attr, None)
            if isinstance(declared, dict):
                return set(declared)
        if dataclasses.is_dataclass(cfg):
            return {f.name for f in dataclasses.fields(cfg)}
        if isinstance(cfg, Mapping):
            return set(cfg)
        return set(vars(cfg)) if hasattr(cfg, "__dict__") else None
