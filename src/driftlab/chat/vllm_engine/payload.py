"""What one vLLM request carries of driftlab: its steer and what the steer refers to, as data.

It rides in `SamplingParams.extra_args["driftlab"]` as plain JSON (vLLM serialises sampling
parameters between its processes), so nothing a request carries is code: the steer is driftlab's
`--steer` grammar (normalised specs, PASTA heads spelt out, never a file), the spans are token
ranges of the request's own prompt, and a persona direction is named by its id in the directions
the engine was started with. No torch and no vLLM here: the driftlab process builds it, the
worker reads it (`step`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

KEY = "driftlab"


class SteerPayload(BaseModel):
    """One request's steer, the token spans it refers to, and what to record.

    `spans` are the rendered prompt's named ranges (`Rendered.spans()`: system, emphasis,
    first_turn); `prompt_len` is the prompt's length (a prompt-scoped bias spares the keys after
    it); `direction` the persona id whose direction the residual steers and projections use
    (None: none); `floors` pi-floor's [layers][heads] values and `first_query` the token the floor
    acts from; `keep_prefill` records every prompt position's projection (a teacher-forced
    transcript); `capture` sums the residual stream over the reply positions (the directions
    protocol); `keep_logits` keeps the whole next-token log-distribution at the prompt's last
    `keep_logits` positions (the distribution measures read teacher-forced contexts: vLLM itself hands
    out a prompt's top log-probabilities only). `id` names the request's telemetry, which the worker
    keeps until it is taken.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    steer: tuple[str, ...] = ()
    spans: dict[str, list[tuple[int, int]]] = {}
    prompt_len: int = Field(ge=1)
    direction: str | None = None
    floors: list[list[float]] | None = None
    first_query: int = Field(0, ge=0)
    keep_prefill: bool = False
    capture: bool = False
    keep_logits: int = Field(0, ge=0)

    def extra_args(self) -> dict[str, Any]:
        return {KEY: self.model_dump(mode="json", exclude_defaults=True) | {"id": self.id, "prompt_len": self.prompt_len}}

    @classmethod
    def of(cls, extra_args: dict[str, Any] | None) -> SteerPayload | None:
        """The payload of a request's extra_args, or None for a request without one (plain)."""
        data = (extra_args or {}).get(KEY)
        return None if data is None else cls.model_validate(data)
