"""What a call asks of the residual stream, as data (no torch: parsing `--steer` stays cheap)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Layers = tuple[int, ...] | None  # None: the directions' own band (chosen on held-out data)
# Other tools' files of directions that driftlab reads and writes (activation.formats).
Format = Literal["assistant-axis", "persona-vectors", "steering-vectors"]
FORMATS: tuple[str, ...] = ("assistant-axis", "persona-vectors", "steering-vectors")


class ResidualConfig(BaseModel):
    """Per row: add `alpha` times the persona's mean difference (with minus without its system
    prompt) at `vector_layers`; clamp the projection onto the persona's direction from below at
    the `cap_q` quantile of its with-prompt projections (or, with "file", at the thresholds an
    imported capping config gave), at `cap_layers`. Zero alpha and no cap leave the stream as it is
    (the row is only monitored)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(0.0, allow_inf_nan=False)
    vector_layers: Layers = None
    cap_q: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | Literal["file"] | None = None
    cap_layers: Layers = None

    @property
    def steers(self) -> bool:
        return self.alpha != 0.0 or self.cap_q is not None


def parse_layers(spec: str | None) -> Layers:
    """'band'/None -> None (the directions' band); '10-14', '3+5+9', '12' -> a sorted tuple of layers."""
    if spec is None or spec.strip().lower() == "band":
        return None
    if spec.strip().lower() in ("all", "*"):
        raise ValueError("name the layers ('0-27') or leave layers out for the directions' band")
    out: set[int] = set()
    for part in filter(None, re.split(r"[+,\s;]+", spec.strip())):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or int(m[2] or m[1]) < int(m[1]):
            raise ValueError(f"cannot read layers '{part}': write a layer '12', a range '10-14' or '3+5+9'")
        out.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return tuple(sorted(out))


def layers_spec(layers: Layers) -> str:
    return "band" if layers is None else "+".join(str(x) for x in layers)
