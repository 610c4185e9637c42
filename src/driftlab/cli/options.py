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
    help="Which tokens count as the system prompt: 'content' (its text, as the paper's pi) or 'prefix' "
         "(its whole rendered turn from position 0, with the template header and the attention sink).")]
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
# Where the model runs (chat.factory.Runtime): an OpenAI-compatible server or a Ray pool
BaseUrlOpt = Annotated[str | None, typer.Option(
    help="OpenAI-compatible server of an openai:MODEL, e.g. http://127.0.0.1:8000/v1 (default: $OPENAI_BASE_URL).")]
ApiKeyEnvOpt = Annotated[str, typer.Option(help="Environment variable that holds the server's API key.")]
ConcurrencyOpt = Annotated[int, typer.Option(help="Requests in flight at once to an openai: server.")]
RayOpt = Annotated[str | None, typer.Option(
    "--ray", help="Shard a local model's work over Ray actors: 'local' starts a cluster here, else its address.")]
ActorsOpt = Annotated[int | None, typer.Option(help="Ray actors (default: one per GPU, else 2).")]


def runtime(base_url: str | None, api_key_env: str, concurrency: int, ray: str | None = None,
            actors: int | None = None) -> Any:
    """The validated `Runtime` of a command's --base-url/--api-key-env/--concurrency/--ray/--actors."""
    from driftlab.chat.factory import Runtime

    return build(Runtime, base_url=base_url, api_key_env=api_key_env, concurrency=concurrency, ray=ray, actors=actors)


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

