"""One row of the theory report: a claim of the paper, what we measured, and whether it held.

Every simulation module returns `Check`s, so the CLI table, the CSV and the markdown summary
are all rendered from the same objects and cannot disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["pass", "FAIL", "info"]


@dataclass(frozen=True)
class Check:
    """A claim checked numerically.

    `status` is "info" for rows that report a number without a pass/fail criterion
    (e.g. the embedding-norm histogram, where the paper's "concentrated around 1" is about
    LLaMA2 and not a property every model must have).
    """

    id: str
    claim: str
    measured: str
    expected: str
    status: Status
    detail: str = ""
    values: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status != "FAIL"

    def row(self) -> dict[str, str]:
        """Flat string view used by the CSV / markdown writers."""
        d = asdict(self)
        d.pop("values")
        return {k: str(v) for k, v in d.items()}


def verdict(ok: bool) -> Status:
    return "pass" if ok else "FAIL"


def fmt(x: float, digits: int = 4) -> str:
    """Compact number formatting that stays readable for both 0.1153 and 3.2e-07."""
    return f"{x:.{digits}g}"
