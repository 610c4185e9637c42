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
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from driftlab.chat.base import ChatBackend, Reply, Sampling, token_backend, validate_conversation
from driftlab.errors import DriftlabError
from driftlab.serve.batcher import Batcher, Job, QueueFull, ServerClosing
from driftlab.serve.drain import Drain
from driftlab.serve.schema import ChatCompletionRequest, unsupported_field
from driftlab.steering.heads import HeadSources, load_head_source
from driftlab.steering.interventions import Interventions, Steer


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


def create_app(model: ChatBackend, settings: ServeSettings = ServeSettings()):
    """The ASGI app serving a local backend (streaming and log-probs need its tokens)."""
    from driftlab.serve.metrics import CONTENT_TYPE, CountResponses, Metrics

    backend = token_backend(model, "driftlab serve")
    default_steer = settings.steer
    request_heads = settings.head_sources()  # read once, here: a request never opens a file
    backend.capabilities.require(backend.name, default_steer)
    served = settings.served_model_name or backend.name
    batcher = Batcher(backend, max_batch_size=1 if settings.deterministic else settings.max_batch_size,
                      max_wait_s=settings.max_wait_ms / 1000, max_queue=settings.max_queue)
    drain = Drain()
    metrics = Metrics(lambda: batcher.waiting, lambda: drain.in_flight)
    batcher.on_batch = metrics.batch

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await asyncio.to_thread(batcher.close)  # the drain has let in-flight requests finish by now

    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="driftlab serve", lifespan=lifespan, **docs)
    app.state.batcher, app.state.drain = batcher, drain
    app.add_middleware(CountResponses, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            return APIError(404, f"Invalid URL ({request.method} {request.url.path}): this server serves "
                                 "POST /v1/chat/completions, GET /v1/models, /health and /metrics.").response()
        if err.status_code == 405:
            return APIError(405, f"{request.method} is not allowed on {request.url.path}.",
                            headers=dict(err.headers or {})).response()
        return APIError(err.status_code, str(err.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):  # logged by the server as well
        return APIError(500, f"The server failed on this request ({type(err).__name__}); it has been logged.",
                        kind="server_error").response()

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), settings.api_key.encode())
        if not ok:
            raise APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.", kind="authentication_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        # Cheap (no lock, no model): answers while the batcher decodes. 503 while draining,
        # so a load balancer stops sending requests here.
        body = {"status": "draining" if drain.draining else "ok", "model": served, "waiting": batcher.waiting,
                "in_flight": drain.in_flight, "batches": batcher.n_batches}
        return JSONResponse(body, status_code=503 if drain.draining else 200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "driftlab",
                                            "driftlab": {"steer": default_steer.specs(),
                                                         "heads": sorted(settings.heads)}}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        if drain.draining:
            raise _closing("The server is shutting down and takes no new requests; retry in a moment.")
        arrived = time.monotonic()
        req = _parse(await _read_body(request, settings.max_body_bytes))
        job = await _job(req)
        loop = asyncio.get_running_loop()
        job.future, job.loop = loop.create_future(), loop
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return _stream(job, req, cid, created, arrived)
        _submit(job, arrived)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            reply = _cut_reply(await _await(job), job, req.stops())
        finally:
            watcher.cancel()
            metrics.latency.observe(time.monotonic() - arrived)
        return JSONResponse(_completion(reply, job, cid, created))

    def _parse(raw: bytes) -> ChatCompletionRequest:
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
        if req.model != served:
            raise APIError(404, f"Model '{req.model}' is not served here; this server serves '{served}'.",
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

    async def _job(req: ChatCompletionRequest) -> Job:
        """The request as a batch job, with every check that concerns it alone done here, before
        it can share a batch: a bad request fails by itself."""
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
        try:
            sampling = Sampling(max_new_tokens=req.new_tokens(min(settings.default_max_tokens, settings.max_tokens_limit)),
                                temperature=req.temperature, top_p=req.top_p, ignore_eos=req.ignore_eos)
        except ValidationError as err:  # e.g. a temperature too small to sample with
            raise _invalid(err) from None
        steer = default_steer
        if req.driftlab is not None and req.driftlab.specs() is not None:
            try:
                steer = Interventions.parse(req.driftlab.specs(), request_heads)
                backend.capabilities.require(backend.name, steer)
            except DriftlabError as err:
                raise APIError(422, f"driftlab.steer: {err}", param="driftlab.steer") from None
        await _check_prompt(conversation, steer, sampling.max_new_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        job = Job(conversation, sampling, seed, steer, logprobs, store=not settings.deterministic)
        if stops := req.stops():
            job.watch = lambda: _stop_watch(job, stops)
        return job

    def _stop_watch(job: Job, stops: list[str]) -> Callable[[int], None]:
        """Ends the job's row once its text holds a stop string (called on the worker thread
        with each token; decodes a tail only, so a long reply costs no quadratic decode)."""
        ids: list[int] = []
        tail = max(len(s) for s in stops) + 8  # tokens: at least one character each, but for partial UTF-8

        def watch(token: int) -> None:
            ids.append(token)
            if find_stop(backend.decode(ids[-tail:]), stops) is not None:
                job.stopped.set()

        return watch

    def _cut_reply(reply: Reply, job: Job, stops: list[str]) -> Reply:
        """The reply cut before its first stop string, `finish_reason` "stop", and its token
        count (usage, log-probs) that of the shortest run of generated tokens that covers the
        returned text: the tokens after the stop, decoded before the row ended, are dropped."""
        if not stops:
            return reply
        raw = backend.decode(reply.token_ids)
        at = find_stop(raw, stops)
        if at is None:
            return replace(reply, finish_reason="stop") if job.stopped.is_set() else reply
        ids = reply.token_ids
        lo, hi = 0, len(ids)  # the smallest k with len(decode(ids[:k])) >= at
        while lo < hi:
            mid = (lo + hi) // 2
            if len(backend.decode(ids[:mid])) >= at:
                hi = mid
            else:
                lo = mid + 1
        text = cut_at(raw[:at], backend.stop_strings).strip()
        return replace(reply, text=text, n_tokens=lo, finish_reason="stop", token_ids=ids[:lo],
                       logprobs=None if reply.logprobs is None else reply.logprobs[:lo])

    async def _check_prompt(conversation: list[dict[str, str]], steer: Interventions, new_tokens: int) -> None:
        """Tokenise the prompt as the model will see it (on a thread: a long one takes a while)
        and check it fits the context window with the reply."""
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

    def _submit(job: Job, arrived: float) -> None:
        """Queue the job, with its deadline; it is in flight (the drain waits for it) until left."""
        try:
            batcher.submit(job)
        except ServerClosing as err:
            raise _closing(str(err)) from None
        except QueueFull as err:
            raise APIError(429, f"The server is at capacity ({err}); retry shortly.", kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        drain.enter(job)
        remaining = settings.request_timeout - (time.monotonic() - arrived)
        timer = job.loop.call_later(max(0.0, remaining), job.abort, RequestTimeout())

        def done(_: asyncio.Future) -> None:  # answered, or aborted: no longer holds up a drain
            timer.cancel()
            drain.leave(job)

        job.future.add_done_callback(done)

    async def _await(job: Job) -> Reply:
        try:
            return await job.future
        except ServerClosing as err:
            raise _closing(str(err)) from None
        except RequestTimeout:
            raise APIError(504, f"The request did not finish within this server's --request-timeout of "
                                f"{settings.request_timeout:g} s; ask for fewer tokens or retry later.",
                           kind="timeout_error") from None
        except DriftlabError as err:
            raise APIError(422, str(err)) from None
        except ClientGone:
            raise APIError(499, "The client closed the connection.") from None
        except Exception as err:  # noqa: BLE001 - the model failed on this request (logged by the batcher)
            raise APIError(500, f"The model failed on this request ({type(err).__name__}); other requests "
                                "are unaffected.", kind="server_error") from None

    def _stream(job: Job, req: ChatCompletionRequest, cid: str, created: int, arrived: float):
        from sse_starlette.sse import EventSourceResponse

        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        job.on_token = lambda tok: job.loop.call_soon_threadsafe(tokens.put_nowait, tok)
        job.future.add_done_callback(lambda _: tokens.put_nowait(None))
        _submit(job, arrived)  # before the response starts, so a closing server still answers 503
        text = TextStream(backend.decode, backend.stop_strings, req.stops())
        opts = req.stream_options

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": served,
                               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

        async def events() -> AsyncIterator[dict[str, str]]:
            try:
                yield {"data": chunk({"role": "assistant", "content": ""})}
                while (tok := await tokens.get()) is not None:
                    if delta := text.push(tok):
                        yield {"data": chunk({"content": delta})}
                try:
                    reply = _cut_reply(await _await(job), job, req.stops())
                except APIError as err:  # the 200 header is sent: the error is an event, then [DONE]
                    metrics.responses.labels(str(err.status)).inc()
                    yield {"data": json.dumps(err.body())}
                    yield {"data": "[DONE]"}
                    return
                if rest := text.finish(reply.text):
                    yield {"data": chunk({"content": rest})}
                yield {"data": chunk({}, reply.finish_reason)}
                if opts is not None and opts.include_usage:
                    yield {"data": json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                               "model": served, "choices": [], "usage": _usage(reply)})}
                yield {"data": "[DONE]"}
            finally:  # also when the client closed the stream: its row leaves the batch
                job.abort(ClientGone())
                metrics.latency.observe(time.monotonic() - arrived)

        return EventSourceResponse(events())

    def _completion(reply: Reply, job: Job, cid: str, created: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                                  "finish_reason": reply.finish_reason, "logprobs": None}
        if reply.logprobs is not None:
            choice["logprobs"] = {"content": [_token_logprob(t.token_id, t.logprob, t.top) for t in reply.logprobs]}
        return {"id": cid, "object": "chat.completion", "created": created, "model": served,
                "choices": [choice], "usage": _usage(reply), "driftlab": {"steer": job.interventions.specs()}}

    def _token_logprob(token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        def entry(i: int, lp: float) -> dict[str, Any]:
            tok = backend.decode([i], skip_special=False)
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

        return {**entry(token_id, logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}

    return app


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
