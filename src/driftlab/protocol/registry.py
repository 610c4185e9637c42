"""Protocols that write run directories, registered by name (as lm-evaluation-harness registers tasks).

A run directory's manifest names its protocol; readers (the report, `driftlab report`)
look the protocol up here for its record schema and how many records a complete run
holds, instead of each hard-coding one protocol's layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from driftlab.errors import DriftlabError


@dataclass(frozen=True)
class ProtocolInfo:
    name: str
    records: TypeAdapter  # the record schema (a discriminated union of pydantic models)
    expected_counts: Callable[[dict[str, Any]], dict[str, int]]  # record kind -> count in a complete run


PROTOCOLS: dict[str, ProtocolInfo] = {}


def register(name: str, records: TypeAdapter, expected_counts: Callable[[dict[str, Any]], dict[str, int]]) -> None:
    PROTOCOLS[name] = ProtocolInfo(name, records, expected_counts)


def protocol_of(manifest: dict[str, Any]) -> ProtocolInfo:
    """The protocol that wrote a manifest (format-1 manifests are all self-chats)."""
    # Each protocol module registers itself on import.
    import driftlab.pasta.evaluate  # noqa: F401
    import driftlab.pasta.profile  # noqa: F401
    import driftlab.pasta.tune  # noqa: F401
    import driftlab.protocol.calibrate  # noqa: F401
    import driftlab.protocol.mmlu  # noqa: F401
    import driftlab.protocol.selfchat  # noqa: F401
    import driftlab.protocol.sweep  # noqa: F401

    name = manifest.get("protocol", "selfchat")
    if name not in PROTOCOLS:
        raise DriftlabError(f"Unknown protocol '{name}' in the manifest.",
                            hint=f"This driftlab knows: {', '.join(sorted(PROTOCOLS))}. Upgrade driftlab?")
    return PROTOCOLS[name]
