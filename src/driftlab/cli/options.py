"""Options shared by several commands, and the one place CLI values become validated configs.

Ranges live in the pydantic models (Sampling, SelfChatConfig, BackendSpec), not in Typer
options: a value is checked once, by the model the library uses too, and a bad one
becomes a one-line error naming the flag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from driftlab.errors import DriftlabError

M = TypeVar("M", bound=BaseModel)

ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Preset name (see `driftlab models list`) or local HF model dir.")
]
DtypeOpt = Annotated[str, typer.Option(
    help="auto, bfloat16, float16 or float32 (auto: bf16 on GPUs and CPUs with native bf16, else float32).")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
SpanOpt = Annotated[str, typer.Option(
    help="Which tokens count as the system prompt: 'prefix' (its whole rendered turn) or 'content' (its text).")]
SteerOpt = Annotated[list[str] | None, typer.Option(
    "--steer",
    help="Intervention, repeatable and composable: 'split-softmax:k=0.9[,heads=0-5]', 'instaboost:m=5', "
         "'spr:p=0.5', 'cfg:alpha=1.5', 'bias:value=2.0[,heads=3+5.1]', 'trace' (see docs/steering.md).",
)]
MaxNewTokensOpt = Annotated[int, typer.Option(help="Most tokens per reply (1-32768).")]
TemperatureOpt = Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")]
GreedyOpt = Annotated[bool, typer.Option(help="Greedy decoding (deterministic).")]
SeedOpt = Annotated[int, typer.Option(help="Seed, 0 to 2^63-1.")]
# MMLU cost (mmlu, calibrate, sweep)
TurnOpt = Annotated[int, typer.Option(help="Ask at this turn of the agent's dialog (paper: 4); 0 = plain MMLU.")]
MMLUSeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the question subset and the dialog.")]
HistoryTokensOpt = Annotated[int, typer.Option(help="Most tokens per turn of the dialog before the question.")]
MMLUDataOpt = Annotated[Path | None, typer.Option("--data", help="An MMLU jsonl file instead of `driftlab data pull mmlu`.")]


def build(schema: type[M], flags: dict[str, str] | None = None, /, **values: Any) -> M:
    """`schema(**values)`, with a validation error turned into one line that names the CLI flag.

    `flags` maps a field name to its flag where they differ (e.g. {'pair_ids': '--pair'}).
    """
    try:
        return schema(**values)
    except ValidationError as err:
        e = err.errors()[0]
        field = next((str(p) for p in reversed(e["loc"]) if isinstance(p, str)), "?")
        flag = (flags or {}).get(field, "--" + field.replace("_", "-"))
        given = e.get("input")
        shown = f" {given}" if isinstance(given, (int, float, str)) and not isinstance(given, bool) else ""
        msg = e["msg"].removeprefix("Value error, ")
        raise DriftlabError(f"Invalid {flag}{shown}: {msg[0].lower() + msg[1:]}.",
                            hint="The command's --help lists every option with its valid values.") from None

