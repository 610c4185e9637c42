"""Protocols by name, as lm-evaluation-harness registers tasks.

A run directory's manifest names the protocol that wrote it; readers (the report, resume
checks, tests) look the protocol up here for its record schema and how many records a
complete run holds. Each protocol class registers itself (`@register`) where it is
defined; this module imports none of them: `protocol_class` imports the modules listed in
`MODULES` on first use, so the registry stays at the bottom of the protocols it serves. Other
packages add protocols through entry points (`driftlab.protocols`, see `driftlab.plugins`),
loaded when a name is not found among driftlab's own.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from driftlab.errors import DriftlabError

if TYPE_CHECKING:
    from driftlab.protocol.runner import Protocol

P = TypeVar("P", bound=type)

#: Where the built-in protocols live (a new protocol module adds itself here).
MODULES = (
    "driftlab.protocol.selfchat",
    "driftlab.protocol.replay",
    "driftlab.protocol.mmlu",
    "driftlab.protocol.lmeval",
    "driftlab.protocol.calibrate",
    "driftlab.protocol.sweep",
    "driftlab.protocol.decay",
    "driftlab.protocol.directions",
    "driftlab.protocol.project",
    "driftlab.protocol.kl",
    "driftlab.pasta.evaluate",
    "driftlab.pasta.profile",
    "driftlab.pasta.tune",
)
PROTOCOLS: dict[str, type[Protocol]] = {}


def register(cls: P) -> P:
    """Class decorator: make a protocol known under its `name`."""
    if PROTOCOLS.get(cls.name, cls) is not cls:
        raise DriftlabError(f"Two protocols are named {cls.name!r}: {PROTOCOLS[cls.name].__module__} and {cls.__module__}.",
                            hint="Rename one of them (a plugin's entry point and class name).")
    PROTOCOLS[cls.name] = cls
    return cls


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(given, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def all_protocols() -> dict[str, type[Protocol]]:
    """Every protocol: driftlab's and those other packages declare (entry points `driftlab.protocols`)."""
    from driftlab.plugins import load
    from driftlab.protocol.runner import Protocol

    for module in MODULES:
        importlib.import_module(module)
    for name, cls in load("driftlab.protocols").items():
        if not (isinstance(cls, type) and issubclass(cls, Protocol)) or getattr(cls, "name", None) != name:
            raise DriftlabError(f"The driftlab.protocols plugin {name!r} is not a Protocol subclass named {name!r}.",
                                hint="Point the entry point at a class Protocol[MyConfig] with name = the entry point's.")
        register(cls)
    return dict(PROTOCOLS)


def protocol_class(name: str) -> type[Protocol]:
    """The protocol registered as `name`."""
    if name not in PROTOCOLS:
        all_protocols()
    if name not in PROTOCOLS:
        raise DriftlabError(f"Unknown protocol '{name}'{did_you_mean(name, PROTOCOLS)}.",
                            hint=f"This driftlab knows: {', '.join(sorted(PROTOCOLS))} (`driftlab protocol list`). "
                                 "A run's manifest names another? Upgrade driftlab, or install the plugin that wrote it.")
    return PROTOCOLS[name]


def protocol_of(manifest: dict[str, Any]) -> type[Protocol]:
    """The protocol that wrote a manifest (format-1 manifests are all self-chats)."""
    return protocol_class(manifest.get("protocol", "selfchat"))
