"""The drift benchmark: 100 system prompts with probes and measures, user-persona probes, conversation starters.

    from driftlab.bench import get_persona, STARTERS
    p = get_persona("reply-in-french")
    p.score("Bonjour ! À Londres, je visite le British Museum.")  # -> close to 1.0

Importing this package is cheap; the libraries behind some measures load on first use.
"""

from driftlab.bench.judge import JUDGE, JudgeParams
from driftlab.bench.measures import MEASURES, register_custom
from driftlab.bench.personas import (
    CATEGORIES,
    USER_SETS,
    MeasureError,
    Persona,
    constraint_personas,
    drift_users,
    get_persona,
    ifeval_constraints,
    load_personas,
    load_user_personas,
)
from driftlab.bench.probes import USER_PROBE_VERSIONS, user_probe, user_probes
from driftlab.bench.starters import STARTER_SETS, STARTERS, starters

__all__ = [
    "CATEGORIES",
    "JUDGE",
    "JudgeParams",
    "MEASURES",
    "MeasureError",
    "STARTERS",
    "STARTER_SETS",
    "USER_PROBE_VERSIONS",
    "USER_SETS",
    "Persona",
    "drift_users",
    "get_persona",
    "constraint_personas",
    "ifeval_constraints",
    "load_personas",
    "load_user_personas",
    "register_custom",
    "starters",
    "user_probe",
    "user_probes",
]
