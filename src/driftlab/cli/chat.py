"""`driftlab chat`: one-shot chat for trying a model (and an intervention) quickly."""

from __future__ import annotations

from typing import Annotated

import typer

ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Preset name (see `driftlab models list`) or local HF model dir.")
]
DtypeOpt = Annotated[str, typer.Option(help="auto, bfloat16, float16 or float32 (auto: bf16 on GPUs and CPUs with native bf16, else float32).")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]


def chat(
    prompt: Annotated[str, typer.Argument(help="The user message.")],
    model: ModelOpt = "smollm2-135m",
    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None,
    greedy: Annotated[bool, typer.Option(help="Greedy decoding (deterministic).")] = False,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature.")] = 1.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.")] = 0.9,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    steer: Annotated[
        list[str] | None,
        typer.Option(
            "--steer",
            help="Intervention, repeatable: 'split-softmax:k=0.9', 'bias:value=2.0[,heads=0-5]', 'trace'.",
        ),
    ] = None,
    span: Annotated[str, typer.Option(help="System-prompt tokens: 'prefix' (rendered turn) or 'content'.")] = "prefix",
) -> None:
    """Send one message and print only the reply on stdout (progress and notes go to stderr)."""
    from rich.console import Console

    from driftlab.chat import Sampling
    from driftlab.chat.hf import HFChatBackend
    from driftlab.steering import parse_steer

    attention = parse_steer(steer or [])
    sampling = Sampling(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy, seed=seed
    )
    backend = HFChatBackend(model, dtype=dtype, device=device, span_mode=span, prefix_cache_bytes=0)
    conversation = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    reply = backend.chat([conversation], sampling, attention=attention)[0]
    typer.echo(reply.text)
    if reply.trace:
        pi = reply.trace["decode"]
        Console(stderr=True).print(
            f"[dim]pi (attention mass on the system prompt), mean over layers and heads, per token: "
            f"{' '.join(f'{v:.2f}' for v in pi.mean(dim=(1, 2)).tolist())}[/]"
        )
