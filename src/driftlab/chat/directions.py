"""Which persona direction each row of a request steers and records along, for every local engine."""

from __future__ import annotations

from collections.abc import Sequence

from driftlab.activation.directions import Directions, PersonaDirection
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions


def row_directions(directions: Directions | None, systems: Sequence[str | None], interventions: Interventions,
                   name: str) -> list[PersonaDirection | None]:
    """Each row's direction, from its system prompt: its persona's (or the file's axis); None where
    nothing is recorded or steered. A residual steer (vector, cap) with no directions, or a row whose
    persona has none, is a one-line error before any work (`name`: the model, for the message)."""
    config = interventions.residual()
    if config is not None and config.steers and directions is None:
        kinds = ", ".join(i.kind for i in interventions.by_hook("residual"))
        raise DriftlabError(f"--steer {kinds} acts along a persona's direction, and {name} was given none.",
                            hint="Compute them with `driftlab directions --model MODEL --out DIR`, then pass "
                                 "--directions DIR.")
    if directions is None:
        return [None] * len(systems)
    if config is not None:
        directions.check_layers(config)
    rows = []
    for i, system in enumerate(systems):
        found = directions.for_system(system)
        if found is None and config is not None and config.steers:
            shown = "no system prompt" if system is None else f"system prompt {system[:60]!r}"
            raise DriftlabError(f"Conversation {i} has {shown}, and the directions at {directions.path} hold "
                                f"none for it (they hold: {', '.join(sorted(directions.personas))}).",
                                hint="Compute directions for this prompt: driftlab directions --system TEXT, "
                                     "or --personas ID,...")
        rows.append(found)
    return rows
