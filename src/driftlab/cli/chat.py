"""`driftlab chat`: one-shot chat for trying a model (and an intervention) quickly."""

from __future__ import annotations

from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import (
    GreedyOpt,
    MaxNewTokensOpt,
    SeedOpt,
    SteerOpt,
    TemperatureOpt,
    TopPOpt,
    backend_options,
    build,
)


@backend_options(remote=True)
def chat(
    prompt: Annotated[str, typer.Argument(help="The user message.")],
    backend: BackendSpec,
    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None,
    greedy: GreedyOpt = False,
    max_new_tokens: MaxNewTokensOpt = 128,
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 0.9,
    seed: SeedOpt = 0,
    steer: SteerOpt = None,
) -> None:
    """Send one message and print only the reply on stdout (progress and notes go to stderr)."""
    from rich.console import Console

    from driftlab.chat import ChatRequest, Sampling, make_backend
    from driftlab.chat.base import MAX_SEED
    from driftlab.errors import DriftlabError
    from driftlab.steering import Interventions
    from driftlab.steering.emphasis import strip_emphasis

    # Everything cheap is checked before the model loads.
    interventions = Interventions.parse(steer)
    sampling = build(Sampling, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy)
    if not 0 <= seed <= MAX_SEED:
        raise DriftlabError(f"Invalid --seed {seed}: use 0 to 2^63-1.")
    conversation = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    marker = interventions.emphasis_marker()
    if marker is not None:  # an unclosed or empty *mark* is the user's to fix: said before a model loads
        strip_emphasis(conversation, marker)
    model = make_backend(backend, prefix_cache_bytes=0)
    model.capabilities.require(model.name, interventions)
    reply = model.generate(ChatRequest([conversation], sampling, seeds=[seed], interventions=interventions))[0]
    typer.echo(reply.text)
    if reply.trace is not None:
        Console(stderr=True).print(
            f"[dim]pi (attention mass on the system prompt), mean over layers and heads, per token: "
            f"{' '.join(f'{v:.2f}' for v in reply.trace.mean().tolist())}[/]"
        )
    if reply.activation is not None:
        act = reply.activation
        band = lambda key: sum(act[key][i] for i in act["band"]) / len(act["band"])  # noqa: E731
        Console(stderr=True).print(
            f"[dim]projection on {act['direction']}'s direction (0: like without the system prompt, 1: like with "
            f"it), mean over layers {act['band'][0]}-{act['band'][-1]}: reply {band('reply'):.2f}, last prompt "
            f"token {band('prompt'):.2f}[/]")
