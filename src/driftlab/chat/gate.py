"""`when-drifting` for every local engine: which rows have drifted, and the steer each row gets.

The decision is one definition here; an engine only supplies its two gauges, read the way it
reads its batch (`Gauged`): `drift_ratio` (pi at the conversation's last token over pi at its
first turn's last token, plain attention) and `projection_drift` (the persona's normalised
projection at those two tokens). A drifted row gets the steer, any other its trace only, and
its reply reports the decision (`Reply.gate`). `by=score` is a replay's, decided before the batch
from the previous turn's score (`score_decision`); an engine refuses it in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from driftlab.chat.base import LogLikelihood, Rendered, system_of, validate_conversation
from driftlab.errors import DriftlabError
from driftlab.messages import Conversation
from driftlab.steering.interventions import Interventions, WhenDrifting


class Gauged(Protocol):
    """What an engine gives `when-drifting` to decide by."""

    def drift_ratio(self, rendered: Rendered) -> float: ...

    def projection_drift(self, rendered: Rendered, system: str | None) -> tuple[float, float]: ...


def gated(engine: Gauged, rendered: Sequence[Rendered], iv: Interventions,
          systems: Sequence[str | None]) -> tuple[list[Interventions], list[dict | None]]:
    """Each row's interventions under `when-drifting` (the steer where the row has drifted, else its
    trace only) and the decision its reply reports; `iv` for every row when there is no gate."""
    found = iv.gated()
    if found is None:
        return [iv] * len(rendered), [None] * len(rendered)
    gate, on, off = found
    engine_reads(gate)
    decisions = [decision(engine, row, system, gate) for row, system in zip(rendered, systems, strict=True)]
    return [on if d["steered"] else off for d in decisions], decisions


def decision(engine: Gauged, rendered: Rendered, system: str | None, gate: WhenDrifting) -> dict:
    """One conversation's decision, as its reply reports it. By projection, a conversation whose first
    turn does not project onto its persona (at most 0: like without its system prompt) has no persona
    to drift from: its ratio is None and it is not steered."""
    if gate.by == "pi":
        ratio = engine.drift_ratio(rendered)
        return {"r": gate.r, "pi_ratio": round(ratio, 6), "steered": ratio < gate.r}
    first, now = engine.projection_drift(rendered, system)
    ratio = now / first if first > 0 else None
    return {"r": gate.r, "by": "projection", "projection_first": round(first, 6), "projection": round(now, 6),
            "projection_ratio": None if ratio is None else round(ratio, 6),
            "steered": ratio is not None and ratio < gate.r}


def engine_reads(gate: WhenDrifting) -> None:
    """One line for a gate an engine cannot decide: `by=score` reads the score of the dialog's previous
    agent turn by its persona's measure, which a replay knows and an engine (or a server) does not."""
    if gate.by == "score":
        raise DriftlabError("when-drifting:by=score steers the turn after a failing one, and only a replay scores "
                            "every agent turn.", hint="Use it with driftlab replay, or by=pi / by=projection here.")


def engine_steer(steer: Interventions) -> Interventions:
    """What an engine is asked to apply: `steer`, less a `by=score` gate (its protocol decides that one)."""
    gate = steer.get("when-drifting")
    return steer.without("when-drifting") if gate is not None and gate.by == "score" else steer


def score_decision(gate: WhenDrifting, previous: float | None) -> dict:
    """A replayed turn's decision under `by=score`: steered where the dialog's previous agent turn scored
    below r. A first turn, or one after a reply the measure could not score (cut at the token limit, an
    error), has no reading: not steered."""
    return {"r": gate.r, "by": "score", "score": previous, "steered": previous is not None and previous < gate.r}


def first_turn_end(spans: dict[str, list[tuple[int, int]]]) -> int:
    """Where a conversation's first turn ends (the gate's reference); a one-line error where it has
    no system prompt or first turn to compare with."""
    if not spans.get("first_turn") or not spans.get("system"):
        raise DriftlabError("when-drifting compares the system prompt's hold (its attention, or the persona's "
                            "projection) with the first turn's, "
                            f"and this conversation has {'no first turn' if spans.get('system') else 'no system prompt'}.",
                            hint="Give conversations with a system prompt and a user turn, rendered by a chat "
                                 "template that renders the first turn as a prefix.")
    return spans["first_turn"][0][1]


def gate_direction(directions, system: str | None, name: str):
    """The persona direction `when-drifting:by=projection` reads for a conversation; a one-line error
    without directions or without one for its system prompt."""
    found = directions.for_system(system) if directions is not None else None
    if found is None:
        held = "no persona directions" if directions is None else \
            f"directions at {directions.path} with none for system prompt {(system or '')[:60]!r}"
        raise DriftlabError(f"when-drifting:by=projection reads the persona's direction, and {name} has {held}.",
                            hint="Pass --directions DIR (driftlab directions), or use by=pi.")
    return found


def gated_loglikelihood(engine, contexts: Sequence[Conversation], continuations: Sequence[str],
                        interventions: Interventions, batch_size: int) -> list[LogLikelihood]:
    """`loglikelihood` under `when-drifting`: the contexts whose conversation has drifted are scored
    under the steer, the others without it, as a reply to them would be made (one call each)."""
    for i, conv in enumerate(contexts):
        validate_conversation(conv, i)
    rendered = [engine.render(interventions.model_view(c), interventions=interventions) for c in contexts]
    ivs, _ = gated(engine, rendered, interventions, [system_of(c) for c in contexts])
    out: dict[int, LogLikelihood] = {}
    for iv in {id(v): v for v in ivs}.values():
        rows = [i for i, v in enumerate(ivs) if v is iv]
        scored = engine.loglikelihood([contexts[i] for i in rows], [continuations[i] for i in rows], iv,
                                      batch_size=batch_size)
        out.update(zip(rows, scored, strict=True))
    return [out[i] for i in range(len(contexts))]
