"""`driftlab serve`: a drift-controlled local model behind an OpenAI-compatible API."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import SteerOpt, backend_options, build


@backend_options()
def serve(
    backend: BackendSpec,
    steer: SteerOpt = None,
    host: Annotated[str, typer.Option(help="Interface to listen on (0.0.0.0 exposes it to the network).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key_env: Annotated[str | None, typer.Option(
        help="Require 'Authorization: Bearer <key>' with the key held in this environment variable.")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help="The model name clients send (default: --model).")] = None,
    max_batch_size: Annotated[int, typer.Option(help="Most requests decoded together.")] = 32,
    max_wait_ms: Annotated[float, typer.Option(help="How long the first waiting request waits for company.")] = 10.0,
    max_tokens_limit: Annotated[int, typer.Option(help="Largest max_tokens a request may ask for.")] = 4096,
    max_messages: Annotated[int, typer.Option(help="Most messages in one request.")] = 512,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted.")] = 4 << 20,
    heads: Annotated[list[str] | None, typer.Option(
        "--heads", help="A PASTA head set requests may name, NAME=PATH (a head config or a profile), repeatable: "
                        "a request's pasta:heads=NAME[,topk=K] uses it; requests can never name a file.")] = None,
    graceful_timeout: Annotated[float, typer.Option(
        help="On SIGINT/SIGTERM, seconds to let in-flight requests finish before cancelling them.")] = 30.0,
) -> None:
    """Serve --model at http://HOST:PORT/v1 (chat completions, streaming, models, /health).

    Every request is decoded under --steer unless it sends its own as
    {"driftlab": {"steer": "split-softmax:k=0.8"}} ([] for none). Concurrent requests are
    batched into one decode loop.
    """
    import uvicorn

    from driftlab.chat import make_backend
    from driftlab.errors import DriftlabError
    from driftlab.serve import ServeSettings, create_app
    from driftlab.steering import Interventions
    from driftlab.steering.heads import HeadSources

    if backend.remote:
        raise DriftlabError("driftlab serve runs a local model; an openai: model is already served.",
                            hint="Give a preset (see `driftlab models list`) or a local HF model directory.")
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise DriftlabError(f"--api-key-env {api_key_env}: the variable is not set or empty.",
                                hint=f"export {api_key_env}=<a long random key> before starting the server.")
    registered = {}
    for entry in heads or []:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise DriftlabError(f"--heads {entry!r} is not NAME=PATH.", hint="E.g. --heads json=runs/tune-json/heads.json")
        registered[name.strip()] = path.strip()
    settings = build(ServeSettings, served_model_name=served_model_name, heads=registered, api_key=api_key,
                     max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_tokens_limit=max_tokens_limit,
                     max_messages=max_messages, max_body_bytes=max_body_bytes, host=host, port=port,
                     graceful_timeout=graceful_timeout)
    # The operator's own --steer may name a registered head set, or a file.
    named = HeadSources(named=settings.head_sources().named)
    settings = settings.model_copy(update={"steer": Interventions.parse(steer, named)})
    _check_free(settings.host, settings.port)  # before the (slow) model load
    app = create_app(make_backend(backend), settings)
    typer.echo(f"serving {settings.served_model_name or backend.model} at http://{host}:{port}/v1"
               f"{' with --steer ' + ' '.join(settings.steer.specs()) if settings.steer else ''}", err=True)
    uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                  timeout_graceful_shutdown=settings.graceful_timeout)).run()


def _check_free(host: str, port: int) -> None:
    """Fail in one line if HOST:PORT cannot be listened on (in use, or not an address here)."""
    import socket

    from driftlab.errors import DriftlabError

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise DriftlabError(f"Cannot listen on {host}:{port}: {err.strerror or err}.",
                            hint="Choose another --port, or stop what is using it.") from None
