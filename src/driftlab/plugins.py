"""Measures, interventions and protocols from other packages, through entry points.

A package extends driftlab without editing it by declaring entry points (pyproject.toml):

    [project.entry-points."driftlab.measures"]
    shouty = "my_pkg.measures:shouty"            # f(text, **params) -> float in [0, 1]
    [project.entry-points."driftlab.interventions"]
    sysboost = "my_pkg.steer:SysBoost"           # a BaseIntervention subclass, kind "sysboost"
    [project.entry-points."driftlab.protocols"]
    count-words = "my_pkg.protocol:CountWords"   # a Protocol subclass with a config_class

Each registry (measures, interventions, protocols) asks `load(group)` the first time a name
is not among its own, so a plugin is imported only when something names one of its kinds (or
a listing asks for all of them). A plugin that fails to import is a one-line error naming the
entry point and its package, never a traceback from inside the import machinery.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from driftlab.errors import DriftlabError

GROUPS = ("driftlab.measures", "driftlab.interventions", "driftlab.protocols")
_LOADED: dict[str, dict[str, Any]] = {}


def load(group: str) -> dict[str, Any]:
    """Every entry point of `group`, loaded once per process: name -> object."""
    if group not in GROUPS:
        raise ValueError(f"unknown plugin group {group!r}; driftlab reads {', '.join(GROUPS)}")
    if group not in _LOADED:
        found: dict[str, Any] = {}
        for ep in metadata.entry_points(group=group):
            try:
                found[ep.name] = ep.load()
            except Exception as err:  # noqa: BLE001 - any failure of someone else's import is theirs
                package = ep.dist.name if ep.dist is not None else "an installed package"
                raise DriftlabError(f"The {group} plugin {ep.name!r} ({ep.value}, from {package}) failed to load: "
                                    f"{type(err).__name__}: {err}",
                                    hint=f"Fix or upgrade {package}, or uninstall it.") from None
        _LOADED[group] = found
    return _LOADED[group]
