"""`driftlab serve`: a drift-controlled local model behind an OpenAI-compatible API.

FastAPI + uvicorn, `/v1/chat/completions` (plain and SSE streaming through sse-starlette),
`/v1/models`, `/health` and `/metrics` (Prometheus). The server applies a default
intervention (`--steer`) to every request; a request may replace it with the extension field
`"driftlab": {"steer": "split-softmax:k=0.8"}` (or `[]` for none). A request never makes the
server open a file: its `pasta:heads=` names a head set the operator registered at start
(`--heads NAME=PATH`) or lists heads inline. Requests are batched by `serve.batcher.Batcher`
into the backend's batched decode loop.

One client cannot break the others: every check that concerns one request (schema, Unicode,
tokenisation, context window) runs before it joins a batch; a request whose client leaves,
or that runs past `--request-timeout`, leaves its batch at the next decode step; the queue
is bounded (`--max-queue`).

Every error, the framework's own 404/405 and 500 included, uses OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a body that is not JSON (or nests
too deeply, or holds a lone surrogate), 401 without the right bearer token, 404 for another
model's name or an unknown path, 405, 413 for an oversized body, 422 for a field with a wrong
type or value (`param` names it), 429 when the queue is full, 500 when the model fails on a
request (that request only), 503 while draining, 504 past the request timeout. A stream that
fails after its 200 header ends with the error as an event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from driftlab.chat.base import (
    ChatBackend,
    Reply,
    Sampling,
    TokenBackend,
    token_backend,
    validate_conversation,
)
from driftlab.errors import DriftlabError
from driftlab.serve.batcher import Batcher, Job, QueueFull, ServerClosing
from driftlab.serve.drain import Drain
from driftlab.serve.schema import ChatCompletionRequest, unsupported_field
from driftlab.steering.heads import HeadSources, load_head_source
from driftlab.steering.interventions import Interventions, Steer

if TYPE_CHECKING:
    from driftlab.serve.metrics import Metrics


class ServeSettings(BaseModel):
    """Limits and defaults of one server (from `driftlab serve`'s flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    served_model_name: str | None = Field(None, min_length=1)
    steer: Steer = Field(default_factory=Interventions, description="the default interventions of every request")
    heads: dict[str, str] = Field(default_factory=dict, description=(
        "head sets requests may name in pasta:heads=NAME: name -> head config or profile file, read at start"))
    api_key: str | None = Field(None, repr=False)
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_wait_ms: float = Field(10.0, ge=0, le=10_000, allow_inf_nan=False)
    max_queue: int = Field(256, ge=1, le=1_000_000, description="requests waiting for a batch; more get 429")
    request_timeout: float = Field(600.0, gt=0, le=86_400, allow_inf_nan=False,
                                   description="seconds from arrival to the last token; later gets 504")
    max_tokens_limit: int = Field(4096, ge=1, le=32768)
    default_max_tokens: int = Field(512, ge=1, le=32768)
    max_messages: int = Field(512, ge=1)
    max_body_bytes: int = Field(4 << 20, ge=1024)
    prefix_cache_mb: float = Field(1024, ge=0, le=1 << 20, allow_inf_nan=False,
                                   description="KV of earlier dialogs kept for reuse (the backend is built with it)")
    deterministic: bool = Field(False, description=(
        "decode each request alone and keep no prefix cache, so a reply never depends on other requests"))
    docs: bool = Field(True, description="serve /docs, /redoc and /openapi.json")

    @field_validator("heads")
    @classmethod
    def _head_set_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z][\w-]*", name) or name.lower() == "all":
                raise ValueError(f"head set name {name!r}: use a word that starts with a letter (not 'all'), "
                                 "so it cannot be read as a head selection or a file")
        return v

    def head_sources(self) -> HeadSources:
        """What requests' `pasta:heads=` may name: the registered head sets, never a file."""
        return HeadSources(named={name: load_head_source(path) for name, path in self.heads.items()}, files=False)

    @property
    def prefix_cache_bytes(self) -> int:
        """The prefix cache to build the backend with (none under --deterministic)."""
        return 0 if self.deterministic else int(self.prefix_cache_mb * (1 << 20))

    # where and how uvicorn listens (used by `driftlab serve`, not by the app itself)
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    graceful_timeout: float = Field(30.0, ge=0, le=3600, allow_inf_nan=False)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class RequestTimeout(Exception):
    """The request ran past --request-timeout."""


class ClientGone(Exception):
    """The client closed its connection before the reply was ready."""


class TextStream:
    """Turns sampled token ids into text deltas that add up to the final reply.

    The final reply is stripped and cut at stop strings (the backend's `stop_strings` and the
    request's `stops`), so trailing whitespace, a possible stop-string prefix and an incomplete
    UTF-8 sequence are held back until more text shows what they are; once a request stop
    string appears, nothing after it is ever sent. `finish` sends whatever of the final text
    is still unsent.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: Sequence[str] = (),
                 stops: Sequence[str] = ()) -> None:
        self.decode = decode  # token ids -> text, special tokens skipped (TokenBackend.decode)
        self.stop_strings, self.stops = tuple(stop_strings), tuple(stops)
        self.hold = max((len(s) for s in (*stop_strings, *stops)), default=0)
        self.ids: list[int] = []
        self.sent = ""
        self.done = False  # a request stop string was reached

    def push(self, token: int) -> str:
        if self.done:
            return ""
        self.ids.append(token)
        raw = self.decode(self.ids)
        if (at := find_stop(raw, self.stops)) is not None:
            raw, self.done = raw[:at], True
        text = raw.lstrip()
        if text.endswith("\ufffd") and not self.done:
            return ""
        if self.done:
            safe = cut_at(text, self.stop_strings).rstrip()
        else:
            safe = (text[: max(0, len(text) - self.hold)] if self.hold else text).rstrip()
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, final: str) -> str:
        delta = final[len(self.sent) :] if final.startswith(self.sent) else ""
        self.sent = final
        return delta


@dataclass(eq=False)
class Call:
    """One chat-completion request past its checks: what its reply (whole or streamed) needs."""

    req: ChatCompletionRequest
    job: Job
    cid: str  # the reply's id, chatcmpl-...
    created: int  # the reply's Unix time
    arrived: float  # time.monotonic() on arrival: the deadline and the latency count from here


@dataclass(eq=False)
class ServerState:
    """Everything the routes of one app share, built once by `create_app`.

    Held by the app (and reachable as `app.state.server`) rather than captured in closures,
    so that each route and each step of a request is a short function that can be read, and
    tested, by itself; two apps in one process (as in tests) never share any of it.
    """

    settings: ServeSettings
    backend: TokenBackend
    request_heads: HeadSources  # read once, at start: a request never opens a file
    served: str  # the model name requests must give
    batcher: Batcher
    drain: Drain
    metrics: Metrics

    @classmethod
    def build(cls, model: ChatBackend, settings: ServeSettings) -> ServerState:
        """Check the backend can serve (a local model, the default steer supported) and build the
        batcher and metrics: a misconfigured server fails here, at start, not on a request."""
        from driftlab.serve.metrics import Metrics

        backend = token_backend(model, "driftlab serve")
        request_heads = settings.head_sources()  # read once, here: a request never opens a file
        backend.capabilities.require(backend.name, settings.steer)
        served = settings.served_model_name or backend.name
        batcher = Batcher(backend, max_batch_size=1 if settings.deterministic else settings.max_batch_size,
                          max_wait_s=settings.max_wait_ms / 1000, max_queue=settings.max_queue)
        drain = Drain()
        metrics = Metrics(lambda: batcher.waiting, lambda: drain.in_flight)
        batcher.on_batch = metrics.batch
        return cls(settings, backend, request_heads, served, batcher, drain, metrics)

    @property
    def default_steer(self) -> Interventions:
        """The interventions of a request that names none (`--steer`)."""
        return self.settings.steer

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The batcher's thread lives as long as the server, so it starts and stops with it."""
        self.batcher.start()
        yield
        await asyncio.to_thread(self.batcher.close)  # the drain has let in-flight requests finish by now

    # -- routes ---------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        """401 unless the request carries the server's key (compared in constant time, so the
        key cannot be guessed from response times); open when no key is set."""
        if self.settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                self.settings.api_key.encode())
        if not ok:
            raise APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                           kind="authentication_error")

    # Route handlers carry comments, not docstrings: FastAPI would publish a docstring in /openapi.json.
    async def health(self) -> JSONResponse:
        # Cheap (no lock, no model): answers while the batcher decodes. 503 while draining,
        # so a load balancer stops sending requests here.
        drain, batcher = self.drain, self.batcher
        body = {"status": "draining" if drain.draining else "ok", "model": self.served, "waiting": batcher.waiting,
                "in_flight": drain.in_flight, "batches": batcher.n_batches}
        return JSONResponse(body, status_code=503 if drain.draining else 200)

    async def prometheus_metrics(self) -> Response:
        # The Prometheus scrape (this app's own registry: no other app's counters).
        from driftlab.serve.metrics import CONTENT_TYPE

        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self) -> dict[str, Any]:
        # The one served model, with the steer and head sets a request may rely on.
        return {"object": "list", "data": [{"id": self.served, "object": "model", "created": 0,
                                            "owned_by": "driftlab",
                                            "driftlab": {"steer": self.default_steer.specs(),
                                                         "heads": sorted(self.settings.heads)}}]}

    async def completions(self, request: Request):
        # Every check before the request joins a batch, then a stream or a whole reply.
        # A draining server takes nothing new (503).
        if self.drain.draining:
            raise _closing("The server is shutting down and takes no new requests; retry in a moment.")
        arrived = time.monotonic()
        req = self._parse(await _read_body(request, self.settings.max_body_bytes))
        call = await self._call(req, arrived)
        if req.stream:
            return self._stream(call)
        return await self._answer(call, request)

    # -- a request, before it joins a batch -----------------------------------------------------
    def _parse(self, raw: bytes) -> ChatCompletionRequest:
        """The body as a request this server accepts: its model, and within its limits."""
        req = _load_request(raw)
        settings = self.settings
        if req.model != self.served:
            raise APIError(404, f"Model '{req.model}' is not served here; this server serves '{self.served}'.",
                           param="model", kind="not_found_error")
        if len(req.messages) > settings.max_messages:
            raise APIError(422, f"messages: {len(req.messages)} messages, at most {settings.max_messages}.",
                           param="messages")
        limit = settings.max_tokens_limit
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(req, name)
            if value is not None and value > limit:
                raise APIError(422, f"{name}: {value} is above this server's limit of {limit}.", param=name)
        return req

    async def _call(self, req: ChatCompletionRequest, arrived: float) -> Call:
        """The request as a job with its future on this loop, and the reply's id."""
        job = await self._job(req)
        loop = asyncio.get_running_loop()
        job.future, job.loop = loop.create_future(), loop
        return Call(req, job, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), arrived)

    async def _job(self, req: ChatCompletionRequest) -> Job:
        """The request as a batch job, with every check that concerns it alone done here, before
        it can share a batch: a bad request fails by itself."""
        conversation = _conversation(req)
        sampling = self._sampling(req)
        steer = self._steer(req)
        await self._check_prompt(conversation, steer, sampling.max_new_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        job = Job(conversation, sampling, seed, steer, logprobs, store=not self.settings.deterministic)
        if stops := req.stops():
            job.watch = lambda: self._stop_watch(job, stops)
        return job

    def _sampling(self, req: ChatCompletionRequest) -> Sampling:
        """The request's sampling, its token limit defaulting to the server's (422 if unusable)."""
        settings = self.settings
        try:
            return Sampling(max_new_tokens=req.new_tokens(min(settings.default_max_tokens, settings.max_tokens_limit)),
                            temperature=req.temperature, top_p=req.top_p, ignore_eos=req.ignore_eos)
        except ValidationError as err:  # e.g. a temperature too small to sample with
            raise _invalid(err) from None

    def _steer(self, req: ChatCompletionRequest) -> Interventions:
        """The request's own interventions, or the server's default; head sets by registered
        name only, and the backend must support them (422 otherwise)."""
        if req.driftlab is None or req.driftlab.specs() is None:
            return self.default_steer
        try:
            steer = Interventions.parse(req.driftlab.specs(), self.request_heads)
            self.backend.capabilities.require(self.backend.name, steer)
        except DriftlabError as err:
            raise APIError(422, f"driftlab.steer: {err}", param="driftlab.steer") from None
        return steer

    async def _check_prompt(self, conversation: list[dict[str, str]], steer: Interventions, new_tokens: int) -> None:
        """Tokenise the prompt as the model will see it (on a thread: a long one takes a while)
        and check it fits the context window with the reply."""
        backend = self.backend

        def render() -> int:
            return len(backend.render(steer.model_view(conversation), interventions=steer).ids)

        try:
            n = await asyncio.to_thread(render)
        except DriftlabError as err:
            raise APIError(422, f"messages: {err}", param="messages") from None
        except Exception as err:  # noqa: BLE001 - the tokenizer's own error, for this request only
            raise APIError(400, f"messages: the model's tokenizer cannot read them ({type(err).__name__}).",
                           param="messages") from None
        limit = backend.shape.max_context
        if limit and n + new_tokens > limit:
            raise APIError(422, f"messages: the prompt is {n} tokens and max_tokens {new_tokens}: together above "
                                f"the model's context window of {limit}; shorten the conversation or ask for "
                                "fewer tokens.", param="messages")

    def _stop_watch(self, job: Job, stops: list[str]) -> Callable[[int], None]:
        """Ends the job's row once its text holds a stop string (called on the worker thread
        with each token; decodes a tail only, so a long reply costs no quadratic decode)."""
        ids: list[int] = []
        tail = max(len(s) for s in stops) + 8  # tokens: at least one character each, but for partial UTF-8
        decode = self.backend.decode

        def watch(token: int) -> None:
            ids.append(token)
            if find_stop(decode(ids[-tail:]), stops) is not None:
                job.stopped.set()

        return watch

    # -- a request in flight ----------------------------------------------------------------------
    def _submit(self, job: Job, arrived: float) -> None:
        """Queue the job, with its deadline; it is in flight (the drain waits for it) until left."""
        try:
            self.batcher.submit(job)
        except ServerClosing as err:
            raise _closing(str(err)) from None
        except QueueFull as err:
            raise APIError(429, f"The server is at capacity ({err}); retry shortly.", kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        drain = self.drain
        drain.enter(job)
        remaining = self.settings.request_timeout - (time.monotonic() - arrived)
        timer = job.loop.call_later(max(0.0, remaining), job.abort, RequestTimeout())

        def done(_: asyncio.Future) -> None:  # answered, or aborted: no longer holds up a drain
            timer.cancel()
            drain.leave(job)

        job.future.add_done_callback(done)

    async def _await(self, job: Job) -> Reply:
        """The job's reply, or the API error that says why there is none."""
        try:
            return await job.future
        except ServerClosing as err:
            raise _closing(str(err)) from None
        except RequestTimeout:
            raise APIError(504, f"The request did not finish within this server's --request-timeout of "
                                f"{self.settings.request_timeout:g} s; ask for fewer tokens or retry later.",
                           kind="timeout_error") from None
        except DriftlabError as err:
            raise APIError(422, str(err)) from None
        except ClientGone:
            raise APIError(499, "The client closed the connection.") from None
        except Exception as err:  # noqa: BLE001 - the model failed on this request (logged by the batcher)
            raise APIError(500, f"The model failed on this request ({type(err).__name__}); other requests "
                                "are unaffected.", kind="server_error") from None

    def _cut_reply(self, reply: Reply, job: Job, stops: list[str]) -> Reply:
        """The reply cut before its first stop string, `finish_reason` "stop", and its token
        count (usage, log-probs) that of the shortest run of generated tokens that covers the
        returned text: the tokens after the stop, decoded before the row ended, are dropped."""
        if not stops:
            return reply
        raw = self.backend.decode(reply.token_ids)
        at = find_stop(raw, stops)
        if at is None:
            return replace(reply, finish_reason="stop") if job.stopped.is_set() else reply
        ids = reply.token_ids
        n = self._tokens_covering(ids, at)
        text = cut_at(raw[:at], self.backend.stop_strings).strip()
        return replace(reply, text=text, n_tokens=n, finish_reason="stop", token_ids=ids[:n],
                       logprobs=None if reply.logprobs is None else reply.logprobs[:n])

    def _tokens_covering(self, ids: list[int], chars: int) -> int:
        """The smallest k with len(decode(ids[:k])) >= chars (a binary search: decoding is
        monotone in the prefix, and a long reply must not cost one decode per token)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.backend.decode(ids[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- the answer -------------------------------------------------------------------------------
    async def _answer(self, call: Call, request: Request) -> JSONResponse:
        """The whole reply as one response; a client that leaves first aborts its job."""
        self._submit(call.job, call.arrived)
        watcher = asyncio.create_task(_watch_disconnect(request, call.job))
        try:
            reply = self._cut_reply(await self._await(call.job), call.job, call.req.stops())
        finally:
            watcher.cancel()
            self.metrics.latency.observe(time.monotonic() - call.arrived)
        return JSONResponse(self._completion(reply, call))

    def _stream(self, call: Call):
        """The reply as server-sent events, its tokens passed from the worker thread to this
        loop as they are sampled."""
        from sse_starlette.sse import EventSourceResponse

        job = call.job
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        job.on_token = lambda tok: job.loop.call_soon_threadsafe(tokens.put_nowait, tok)
        job.future.add_done_callback(lambda _: tokens.put_nowait(None))
        self._submit(job, call.arrived)  # before the response starts, so a closing server still answers 503
        text = TextStream(self.backend.decode, self.backend.stop_strings, call.req.stops())
        return EventSourceResponse(self._events(call, tokens, text))

    async def _events(self, call: Call, tokens: asyncio.Queue[int | None],
                      text: TextStream) -> AsyncIterator[dict[str, str]]:
        """The stream's events: a role chunk, text deltas as they become safe to send, then the
        end (see `_last_events`)."""
        try:
            yield {"data": self._chunk(call, {"role": "assistant", "content": ""})}
            while (tok := await tokens.get()) is not None:
                if delta := text.push(tok):
                    yield {"data": self._chunk(call, {"content": delta})}
            for event in await self._last_events(call, text):
                yield event
        finally:  # also when the client closed the stream: its row leaves the batch
            call.job.abort(ClientGone())
            self.metrics.latency.observe(time.monotonic() - call.arrived)

    async def _last_events(self, call: Call, text: TextStream) -> list[dict[str, str]]:
        """The end of a stream: the unsent rest of the text, the finish reason, usage if asked
        for, `[DONE]`; or, since the 200 header is sent, the error as an event, then `[DONE]`."""
        try:
            reply = self._cut_reply(await self._await(call.job), call.job, call.req.stops())
        except APIError as err:
            self.metrics.responses.labels(str(err.status)).inc()
            return [{"data": json.dumps(err.body())}, {"data": "[DONE]"}]
        events = []
        if rest := text.finish(reply.text):
            events.append({"data": self._chunk(call, {"content": rest})})
        events.append({"data": self._chunk(call, {}, reply.finish_reason)})
        opts = call.req.stream_options
        if opts is not None and opts.include_usage:
            events.append({"data": json.dumps({"id": call.cid, "object": "chat.completion.chunk",
                                               "created": call.created, "model": self.served, "choices": [],
                                               "usage": _usage(reply)})})
        events.append({"data": "[DONE]"})
        return events

    def _chunk(self, call: Call, delta: dict[str, Any], finish: str | None = None) -> str:
        """One `chat.completion.chunk` event's data."""
        return json.dumps({"id": call.cid, "object": "chat.completion.chunk", "created": call.created,
                           "model": self.served,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    def _completion(self, reply: Reply, call: Call) -> dict[str, Any]:
        """The `chat.completion` body, with log-probs if asked for and the steer that was applied."""
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                                  "finish_reason": reply.finish_reason, "logprobs": None}
        if reply.logprobs is not None:
            choice["logprobs"] = {"content": [self._token_logprob(t.token_id, t.logprob, t.top)
                                              for t in reply.logprobs]}
        return {"id": call.cid, "object": "chat.completion", "created": call.created, "model": self.served,
                "choices": [choice], "usage": _usage(reply), "driftlab": {"steer": call.job.interventions.specs()}}

    def _token_logprob(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        """One token's log-prob entry in OpenAI's form (text with special tokens, and its bytes)."""
        def entry(i: int, lp: float) -> dict[str, Any]:
            tok = self.backend.decode([i], skip_special=False)
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

        return {**entry(token_id, logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}


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
                             "POST /v1/chat/completions, GET /v1/models, /health and /metrics.").response()
    if err.status_code == 405:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}.",
                        headers=dict(err.headers or {})).response()
    return APIError(err.status_code, str(err.detail)).response()


async def _internal(request: Request, err: Exception) -> JSONResponse:  # logged by the server as well
    """Any other failure as a 500 that names the exception's type only (no internals leak)."""
    return APIError(500, f"The server failed on this request ({type(err).__name__}); it has been logged.",
                    kind="server_error").response()


def _load_request(raw: bytes) -> ChatCompletionRequest:
    """The body as a chat request (400 not JSON, 422 a wrong or unsupported field), before any
    check that depends on this server."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "The body nests JSON too deeply to be a chat request.") from None
    except ValueError as err:
        raise APIError(400, f"The body is not valid JSON: {err}.") from None
    if (name := unsupported_field(data)) is not None:
        raise APIError(422, f"{name}: not supported by driftlab serve (it would be ignored, which changes "
                            "what the reply means); leave it out or send its neutral value.", param=name)
    try:
        req = ChatCompletionRequest.model_validate(data)
    except ValidationError as err:
        raise _invalid(err) from None
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true.", param="top_logprobs")
    return req


def _conversation(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as a conversation the model can take: valid Unicode (a lone surrogate
    would fail the tokenizer inside a shared batch) and a valid turn order."""
    conversation = [m.as_message() for m in req.messages]
    for i, message in enumerate(conversation):
        try:
            message["content"].encode("utf-8")
        except UnicodeEncodeError as err:
            raise APIError(400, f"messages.{i}.content holds a lone UTF-16 surrogate at character {err.start}; "
                           "send valid Unicode text.", param=f"messages.{i}.content") from None
    try:
        validate_conversation(conversation)
    except DriftlabError as err:
        raise APIError(422, f"messages: {err}", param="messages") from None
    return conversation


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first of `stops` begins in `text` (None: nowhere)."""
    return min((i for s in stops if (i := text.find(s)) >= 0), default=None)


def cut_at(text: str, stops: Sequence[str]) -> str:
    at = find_stop(text, stops)
    return text if at is None else text[:at]


def _closing(message: str) -> APIError:
    return APIError(503, message, kind="server_error", headers={"Retry-After": "5"})


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Abort `job` when its client closes the connection (the body is read: the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.abort(ClientGone())


def _invalid(err: ValidationError) -> APIError:
    """422 naming the first invalid field, e.g. `messages.0.role: Input should be ...`."""
    e = err.errors()[0]
    param = ".".join(str(p) for p in e["loc"])
    return APIError(422, f"{param}: {e['msg'].removeprefix('Value error, ')}", param=param)


def _usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.n_prompt_tokens, "completion_tokens": reply.n_tokens,
            "total_tokens": reply.n_prompt_tokens + reply.n_tokens}


async def _read_body(request: Any, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The body is {declared} bytes; this server accepts at most {limit}.")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"The body exceeds this server's limit of {limit} bytes.")
    return bytes(body)
