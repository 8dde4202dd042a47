"""The README's one-import switch for prime-rl's #2951-era loss module (``packloss.compat.prime_rl``);
the adapters themselves live in ``packloss.integrations``."""
