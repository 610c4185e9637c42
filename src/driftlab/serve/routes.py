"""The app: `create_app` assembles the shared state (`serve.app.ServerState`), the routes
(chat completions there, text completions and the tokenizer in `serve.completions`) and the
error handlers that put every error, the framework's own included, in OpenAI's shape."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from driftlab.chat.base import ChatBackend
from driftlab.serve.app import ServerState, ServeSettings
from driftlab.serve.completions import Completions, Tokenizer
from driftlab.serve.wire import APIError


def create_app(model: ChatBackend, settings: ServeSettings = ServeSettings()):
    """The ASGI app serving a local backend (streaming and log-probs need its tokens): the
    shared state, its routes and error handlers, and the batcher's lifespan."""
    from driftlab.serve.metrics import CountResponses

    state = ServerState.build(model, settings)
    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="driftlab serve", lifespan=state.lifespan, **docs)
    app.state.server, app.state.batcher, app.state.drain = state, state.batcher, state.drain
    app.add_middleware(CountResponses, metrics=state.metrics)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    """The API: /health and /metrics open (probes and scrapers hold no key), the rest behind
    the key."""
    authorized = [Depends(state.authorize)]
    app.get("/health")(state.health)
    app.get("/metrics")(state.prometheus_metrics)
    app.get("/v1/models", dependencies=authorized)(state.models)
    app.post("/v1/chat/completions", dependencies=authorized)(state.completions)
    app.post("/v1/completions", dependencies=authorized)(Completions(state).route)
    tokens = Tokenizer(state)
    app.get("/tokenizer_info", dependencies=authorized)(tokens.info)
    app.post("/tokenize", dependencies=authorized)(tokens.tokenize)
    app.post("/detokenize", dependencies=authorized)(tokens.detokenize)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape, the framework's own 404/405 and 500 included, so an
    OpenAI client can read any of them."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return err.response()


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """The framework's errors (unknown path, wrong method) in OpenAI's shape, saying what is served."""
    if err.status_code == 404:
        return APIError(404, f"Invalid URL ({request.method} {request.url.path}): this server serves "
                             "POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize, GET /v1/models, "
                             "/tokenizer_info, /health and /metrics.").response()
    if err.status_code == 405:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}.",
                        headers=dict(err.headers or {})).response()
    return APIError(err.status_code, str(err.detail)).response()


async def _internal(request: Request, err: Exception) -> JSONResponse:  # logged by the server as well
    """Any other failure as a 500 that names the exception's type only (no internals leak)."""
    return APIError(500, f"The server failed on this request ({type(err).__name__}); it has been logged.",
                    kind="server_error").response()
