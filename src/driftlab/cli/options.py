"""The flags shared by several commands; what they mean lives in `driftlab.api.options`.

Ranges live in the pydantic models (Sampling, SelfChatConfig, BackendSpec), not in Typer
options: a value is checked once, by the model the library uses too, and a bad one becomes a
one-line error naming the flag. Options reach the same functions `dl.selfchat/mmlu/sweep`
call (`api.options`), spelt as flags. The options that choose a backend are declared once
(`backend_options`) and reach a command as one `BackendSpec`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel

from driftlab.assets.registry import DEFAULT_MODEL

M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound=Callable[..., Any])

ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", help="Preset name (see `driftlab models list`), local HF model dir, or Hugging Face Hub id "
                          "org/name[@revision] (from the HF cache, downloaded if missing and the hub is reachable).")]
RemoteModelOpt = Annotated[str, typer.Option(
    "--model", "-m", help="Preset name (see `driftlab models list`), local HF model dir, Hugging Face Hub id "
                          "org/name[@revision], or openai:NAME for a model behind an OpenAI-compatible server "
                          "(with --base-url).")]
DtypeOpt = Annotated[str, typer.Option(
    help="auto, bfloat16, float16 or float32 (auto: bf16 on GPUs and CPUs with native bf16, else float32).")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
DeviceMapOpt = Annotated[str | None, typer.Option(
    help="Spread a model too big for one device over GPUs and CPU (accelerate): auto, balanced, sequential, or a "
         'JSON object {module: device}, e.g. \'{"model.layers.0": 0, "": "cpu"}\'. Overrides --device.')]
QuantizeOpt = Annotated[str | None, typer.Option(
    help="Load the weights in 8bit or 4bit (bitsandbytes; needs a CUDA GPU and `pip install bitsandbytes`).")]
DecodeOpt = Annotated[str, typer.Option(
    help="Decode loop of a local model: 'dynamic' (a dynamic KV cache), 'static' (a static cache), 'compiled' "
         "(a static cache and torch.compile: CUDA graphs on a GPU; compiles a plain and a steered graph per batch "
         "size first, kept in driftlab's cache: `driftlab models warm`) or 'auto' (compiled on CUDA, dynamic "
         "elsewhere). Where a static cache cannot serve the model, it stays dynamic.")]
DirectionsOpt = Annotated[str | None, typer.Option(
    help="Persona directions (a `driftlab directions` output directory): record each reply's projection onto its "
         "persona's direction (0: like without the system prompt, 1: like with it); --steer vector and cap use them.")]
SpanOpt = Annotated[str, typer.Option(
    help="Which tokens count as the system prompt: 'content' (its text, as the paper's pi) or 'prefix' "
         "(its whole rendered turn from position 0, with the template header and the attention sink).")]
SteerOpt = Annotated[list[str] | None, typer.Option(
    "--steer",
    help="Intervention, repeatable and composable: 'split-softmax:k=0.9[,heads=0-5]', 'instaboost:m=5', "
         "'spr:p=0.5', 'cfg:alpha=1.5', 'bias:value=2.0[,heads=3+5.1]', 'trace', 'pi-floor:f=0.8', and with "
         "--directions 'vector:alpha=1', 'cap:q=0.25' (see docs/steering.md).",
)]
MaxNewTokensOpt = Annotated[int, typer.Option(help="Most tokens per reply (1-32768).")]
TemperatureOpt = Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")]
GreedyOpt = Annotated[bool, typer.Option(help="Greedy decoding (deterministic).")]
SeedOpt = Annotated[int, typer.Option(help="Seed, 0 to 2^63-1.")]
ProbeTokensOpt = Annotated[str, typer.Option(
    help="Most tokens per probe reply, apart from a turn's --max-new-tokens (default 400, what the reference code "
         "likenneth/persona_drift gives its probes: a probe cut short is scored on what it holds); 'turn': the "
         "turn's budget (runs recorded before this option).")]
ProbeAfterOpt = Annotated[str, typer.Option(
    help="Where the probe of round i goes: 'agent' (after the agent's reply b_i, as the reference code "
         "likenneth/persona_drift that produced the paper's figures does) or 'user' (replaces the user's turn a_i, "
         "the paper's text; round 1 sees no exchange).")]
# MMLU cost (mmlu, calibrate, sweep)
TurnOpt = Annotated[int, typer.Option(
    help="Ask at this turn of the agent's dialog (paper: 4), counted as --turn-counting says; 0 = plain MMLU.")]
TurnCountingOpt = Annotated[str, typer.Option(
    help="How --turn counts: 'paper' (messages, as the reference code likenneth/persona_drift counts: a_1 = 1, "
         "b_1 = 2; the question follows the first TURN, so turn 4 = round 3) or 'round' (the question is the user "
         "turn of round TURN; driftlab before this option).")]
MMLUSeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the question subset and the dialog.")]
HistoryTokensOpt = Annotated[int, typer.Option(help="Most tokens per turn of the dialog before the question.")]
HistoriesOpt = Annotated[int, typer.Option(
    "--histories", help="Dialogs the questions are spread over, evenly (default 1: the paper's choice, every question "
                        "after one dialog, so the drop rests on one context; with several, its test counts dialogs, "
                        "not questions, as the evidence).")]
TiesOpt = Annotated[str, typer.Option(
    "--ties", help="Letters tied at the top log-likelihood: 'random' (one of them, seeded by --seed and the question, "
                   "the same in every condition) or 'first' (A before B ...; runs recorded before this option).")]
MMLUDataOpt = Annotated[Path | None, typer.Option("--data", help="An MMLU jsonl file instead of `driftlab data pull mmlu`.")]
# Where the model runs (chat.spec.Runtime): an OpenAI-compatible server or a Ray pool
BaseUrlOpt = Annotated[str | None, typer.Option(
    help="OpenAI-compatible server of an openai:MODEL, e.g. http://127.0.0.1:8000/v1 (default: $OPENAI_BASE_URL).")]
ApiKeyEnvOpt = Annotated[str, typer.Option(help="Environment variable that holds the server's API key.")]
ConcurrencyOpt = Annotated[int, typer.Option(help="Requests in flight at once to an openai: server.")]
TimeoutOpt = Annotated[float, typer.Option(
    help="Seconds an openai: server has to answer one request before it is retried (or the command stops).")]
MaxRetriesOpt = Annotated[int, typer.Option(
    help="Retries of a request to an openai: server on 429, 5xx, timeouts and dropped connections.")]
RayOpt = Annotated[str | None, typer.Option(
    "--ray", help="Shard a local model's work over Ray actors: 'local' starts a cluster here, else its address.")]
ActorsOpt = Annotated[int | None, typer.Option(help="Ray actors (default: one per GPU, else 2).")]
# vLLM's engine (chat.spec.Runtime): a vllm:MODEL
TensorParallelOpt = Annotated[int, typer.Option(
    "--tensor-parallel", help="vllm: models: GPUs the model is split over (vLLM's tensor parallelism).")]
MemoryFractionOpt = Annotated[float | None, typer.Option(
    help="vllm: models: share of the GPU's memory (a CPU host's) vLLM's engine takes (default: 0.92 on a GPU, "
         "a 2 GiB KV cache on a CPU).")]
MaxModelLenOpt = Annotated[int | None, typer.Option(help="vllm: models: longest context the engine serves "
                                                         "(default: the model's).")]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching",
    help="vllm: models: reuse the KV cache of shared prompt prefixes (a steered request only reuses its own steer's).")]


# name -> (annotation, default) of each option that chooses a backend, by group
_LOCAL = {"model": (ModelOpt, DEFAULT_MODEL), "dtype": (DtypeOpt, "auto"), "device": (DeviceOpt, "auto"),
          "device_map": (DeviceMapOpt, None), "quantize": (QuantizeOpt, None), "decode": (DecodeOpt, "auto"),
          "directions": (DirectionsOpt, None)}
_SPAN = {"span": (SpanOpt, "content")}
_REMOTE = {"base_url": (BaseUrlOpt, None), "api_key_env": (ApiKeyEnvOpt, "OPENAI_API_KEY"),
           "concurrency": (ConcurrencyOpt, 8), "timeout": (TimeoutOpt, 300.0), "max_retries": (MaxRetriesOpt, 5)}
_RAY = {"ray": (RayOpt, None), "actors": (ActorsOpt, None)}
_VLLM = {"tensor_parallel": (TensorParallelOpt, 1), "memory_fraction": (MemoryFractionOpt, None),
         "max_model_len": (MaxModelLenOpt, None), "prefix_caching": (PrefixCachingOpt, True)}


def backend_options(*, span: bool = True, remote: bool = False, ray: bool = False) -> Callable[[F], F]:
    """Give a command the options that choose its backend, as one validated `backend: BackendSpec`.

    --model, --dtype, --device, --device-map, --quantize, --decode and --directions always, and vLLM's engine
    options (--tensor-parallel, --memory-fraction, --max-model-len, --prefix-caching); --span (which tokens are the
    system prompt) unless `span=False`; --base-url, --api-key-env, --concurrency, --timeout and
    --max-retries for commands that may run on an OpenAI-compatible server (`remote`); --ray
    and --actors for those that can shard a local model over Ray (`ray`). The command declares
    a `backend` parameter; the options take its place in the signature Typer reads.
    """
    options = {**_LOCAL, **_VLLM, **(_SPAN if span else {}), **(_REMOTE if remote else {}), **(_RAY if ray else {})}
    if remote:
        options["model"] = (RemoteModelOpt, DEFAULT_MODEL)

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)  # Typer reads the annotations themselves
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
                 for name, (annotation, default) in options.items()]
        params = []  # keyword-only, so required and optional ones may mix; --help lists them in this order
        for p in signature.parameters.values():
            params += added if p.name == "backend" else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in options}
            return command(**kwargs, backend=backend_spec(**values))

        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def backend_spec(model: str, dtype: str = "auto", device: str = "auto", **options: Any) -> Any:
    """The validated `BackendSpec` of the backend options, with a one-line error naming a bad flag."""
    from driftlab.api.options import FLAGS
    from driftlab.api.options import backend_spec as spec

    return spec(model, FLAGS, dtype=dtype, device=device, **options)


def build(schema: type[M], flags: dict[str, str] | None = None, /, **values: Any) -> M:
    """`schema(**values)`, with a validation error turned into one line that names the CLI flag
    (`driftlab.api.options.validated`); `flags` maps a field to its flag where they differ
    (e.g. {'max_batch_size': '--max-batch'})."""
    from driftlab.api.options import FLAGS, validated

    renames = {field: flag.removeprefix("--").replace("-", "_") for field, flag in (flags or {}).items()}
    return validated(schema, FLAGS, renames, **values)
