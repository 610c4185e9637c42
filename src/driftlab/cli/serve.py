"""`driftlab serve`: a drift-controlled local model behind an OpenAI-compatible API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import SteerOpt, backend_options, build


@backend_options()
def serve(
    backend: BackendSpec,
    steer: SteerOpt = None,
    host: Annotated[str, typer.Option(
        help="Interface to listen on. Anything but loopback (e.g. 0.0.0.0) needs an API key or --insecure-no-auth.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key_env: Annotated[str | None, typer.Option(
        help="Require 'Authorization: Bearer <key>' with the key held in this environment variable.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        help="Require 'Authorization: Bearer <key>' with the key read from this file (first line).")] = None,
    insecure_no_auth: Annotated[bool, typer.Option(
        help="Serve a non-loopback --host without an API key (anyone who reaches the port may use the model).")
    ] = False,
    served_model_name: Annotated[str | None, typer.Option(
        help="The model name clients send (default: --model).")] = None,
    max_batch_size: Annotated[int, typer.Option("--max-batch", "--max-batch-size",
                                                help="Most requests decoded together.")] = 32,
    max_wait_ms: Annotated[float, typer.Option(help="How long the first waiting request waits for company.")] = 10.0,
    max_queue: Annotated[int, typer.Option(
        help="Most requests waiting for a batch; more are refused with 429 and Retry-After.")] = 256,
    request_timeout: Annotated[float, typer.Option(
        help="Seconds from a request's arrival to its last token; past it the request ends with 504.")] = 600.0,
    max_tokens_limit: Annotated[int, typer.Option(help="Largest max_tokens a request may ask for.")] = 4096,
    max_messages: Annotated[int, typer.Option(help="Most messages in one request.")] = 512,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted.")] = 4 << 20,
    prefix_cache_mb: Annotated[float, typer.Option(
        help="Memory for the KV of earlier requests, reused when a dialog comes back longer (0: none).")] = 1024,
    deterministic: Annotated[bool, typer.Option(
        help="Decode each request alone, with no prefix cache: a reply never depends on other requests "
             "(in any dtype), at the cost of batching's throughput.")] = False,
    batching: Annotated[str, typer.Option(
        help="continuous: a request joins the running batch at the next decode step (vLLM-style); static: it "
             "waits for the batch to finish.")] = "continuous",
    telemetry: Annotated[bool, typer.Option(
        help="Measure pi on every chat request, for /metrics' drift histograms (a request can also ask for "
             "its own with driftlab.telemetry).")] = False,
    telemetry_prompts: Annotated[int, typer.Option(
        help="System prompts /metrics labels one by one (a hash each); later ones share the label 'other'.")] = 32,
    docs: Annotated[bool, typer.Option(help="Serve the API docs pages (/docs, /redoc, /openapi.json).")] = True,
    heads: Annotated[list[str] | None, typer.Option(
        "--heads", help="A PASTA head set requests may name, NAME=PATH (a head config or a profile), repeatable: "
                        "a request's pasta:heads=NAME[,topk=K] uses it; requests can never name a file.")] = None,
    graceful_timeout: Annotated[float, typer.Option(
        help="On SIGTERM/SIGINT: refuse new requests (503), give those in flight this many seconds, then "
             "end what is left (503, or an error event and [DONE] on a stream) and exit 0.")] = 30.0,
) -> None:
    """Serve --model at http://HOST:PORT/v1 (chat completions, streaming, models, /health, /metrics).

    Every request is decoded under --steer unless it sends its own as
    {"driftlab": {"steer": "split-softmax:k=0.8"}} ([] for none). Concurrent requests are
    batched into one decode loop.
    """
    from driftlab.chat import make_backend
    from driftlab.errors import DriftlabError
    from driftlab.serve import ServeSettings, create_app
    from driftlab.serve.drain import run_server
    from driftlab.steering import Interventions
    from driftlab.steering.heads import HeadSources

    if backend.remote:
        raise DriftlabError("driftlab serve runs a local model; an openai: model is already served.",
                            hint="Give a preset (see `driftlab models list`) or a local HF model directory.")
    api_key = _api_key(api_key_env, api_key_file)
    if api_key is None and not insecure_no_auth and not _loopback(host):
        raise DriftlabError(f"--host {host} exposes the server beyond this machine, and no API key is set.",
                            hint="Give --api-key-env VAR or --api-key-file PATH, or --insecure-no-auth if "
                                 "everyone who can reach the port may use it.")
    registered = {}
    for entry in heads or []:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise DriftlabError(f"--heads {entry!r} is not NAME=PATH.", hint="E.g. --heads json=runs/tune-json/heads.json")
        registered[name.strip()] = path.strip()
    settings = build(ServeSettings, {"max_batch_size": "--max-batch"}, served_model_name=served_model_name,
                     heads=registered, api_key=api_key, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                     max_queue=max_queue, request_timeout=request_timeout, max_tokens_limit=max_tokens_limit,
                     max_messages=max_messages, max_body_bytes=max_body_bytes, prefix_cache_mb=prefix_cache_mb,
                     deterministic=deterministic, batching=batching, telemetry=telemetry, telemetry_prompts=telemetry_prompts,
                     docs=docs, host=host, port=port,
                     graceful_timeout=graceful_timeout)
    # The operator's own --steer may name a registered head set, or a file.
    named = HeadSources(named=settings.head_sources().named)
    settings = settings.model_copy(update={"steer": Interventions.parse(steer, named)})
    _check_free(settings.host, settings.port)  # before the (slow) model load
    if api_key is None and not _loopback(host):
        typer.echo(f"warning: --insecure-no-auth: anyone who can reach {host}:{port} may use this model.", err=True)
    app = create_app(make_backend(backend, prefix_cache_bytes=settings.prefix_cache_bytes), settings)
    typer.echo(f"serving {settings.served_model_name or backend.model} at http://{host}:{port}/v1"
               f"{' with --steer ' + ' '.join(settings.steer.specs()) if settings.steer else ''}"
               f"{' (deterministic: one request at a time)' if deterministic else ''}", err=True)
    run_server(app, settings.host, settings.port, settings.graceful_timeout)


def _api_key(env: str | None, file: Path | None) -> str | None:
    """The key clients must send, from an environment variable or a file (never a flag's value:
    command lines are visible to every user of the machine)."""
    from driftlab.errors import DriftlabError

    if env is not None and file is not None:
        raise DriftlabError("--api-key-env and --api-key-file both given.", hint="Keep one of them.")
    if env is not None:
        key = os.environ.get(env, "").strip()
        if not key:
            raise DriftlabError(f"--api-key-env {env}: the variable is not set or empty.",
                                hint=f"export {env}=<a long random key> before starting the server.")
        return key
    if file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise DriftlabError(f"--api-key-file {file}: cannot read it ({getattr(err, 'strerror', None) or err}).",
                                hint="Give a readable text file whose first line is the key.") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise DriftlabError(f"--api-key-file {file}: the first line is empty.",
                                hint="Write the key on its first line, e.g. `openssl rand -hex 32 > key.txt`.")
        return key
    return None


def _loopback(host: str) -> bool:
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


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
