"""`driftlab serve`: a drift-controlled local model behind an OpenAI-compatible API.

FastAPI + uvicorn. This module holds the server's settings, its shared state
(`ServerState`: the steps every request goes through) and the chat-completions route (plain
and SSE streaming through sse-starlette); `serve.completions` the text-completions and
tokenizer routes, `serve.routes` the assembly (`create_app`), `serve.wire` the errors and
text streaming they share. The server applies a default intervention (`--steer`) to every
request; a request may replace it with the extension field `"driftlab": {"steer":
"split-softmax:k=0.8"}` (or `[]` for none), or name a steer in its model (`NAME+SPEC`). A request never makes the
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
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from driftlab.chat.base import (
    MAX_SEED,
    ChatBackend,
    Reply,
    Sampling,
    TokenBackend,
    TokenLogprob,
    token_backend,
    validate_conversation,
)
from driftlab.chat.constrain import check_schema
from driftlab.errors import DriftlabError
from driftlab.serve.batcher import Batcher, Job, QueueFull, ServerClosing
from driftlab.serve.drain import Drain
from driftlab.serve.schema import ChatCompletionRequest, SamplingFields, TelemetryOptions, unsupported_field
from driftlab.serve.telemetry import PromptLabels, summary, system_of, traced
from driftlab.serve.wire import (
    APIError,
    ClientGone,
    RequestTimeout,
    TextStream,
    closing,
    cut_at,
    find_stop,
    invalid,
    load_body,
    read_body,
)
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
    batching: Literal["continuous", "static"] = Field("continuous", description=(
        "continuous: a request joins the running batch at the next decode step; static: it waits for the next batch"))
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
    telemetry: bool = Field(False, description=(
        "measure pi on every chat request (for /metrics), not only on those that ask for telemetry"))
    telemetry_prompts: int = Field(32, ge=0, le=10_000, description=(
        "system prompts /metrics labels one by one; later ones are labelled 'other'"))
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


@dataclass(eq=False)
class Call:
    """One chat-completion request past its checks: what its reply (whole or streamed) needs."""

    req: ChatCompletionRequest
    job: Job
    cid: str  # the reply's id, chatcmpl-...
    created: int  # the reply's Unix time
    arrived: float  # time.monotonic() on arrival: the deadline and the latency count from here
    more: list[Job] = field(default_factory=list)  # choices 2..n (n > 1, not streamed)
    steer: Interventions = field(default_factory=Interventions)  # as the request asked (without telemetry's trace)
    telemetry: TelemetryOptions | None = None  # the reply carries driftlab.telemetry
    scored: list[TokenLogprob] = field(default_factory=list)  # a stream's token log-probs, as sampled
    sent: int = 0  # how many of them chunks have carried


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
    labels: PromptLabels  # /metrics' label of each system prompt, bounded

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
                          max_wait_s=settings.max_wait_ms / 1000, max_queue=settings.max_queue,
                          continuous=settings.batching == "continuous")
        drain = Drain()
        metrics = Metrics(lambda: batcher.waiting, lambda: drain.in_flight)
        batcher.on_batch = metrics.batch
        return cls(settings, backend, request_heads, served, batcher, drain, metrics,
                   PromptLabels(settings.telemetry_prompts))

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
            raise closing("The server is shutting down and takes no new requests; retry in a moment.")
        arrived = time.monotonic()
        req = self._parse(await read_body(request, self.settings.max_body_bytes))
        call = await self._call(req, arrived)
        if req.stream:
            return self._stream(call)
        return await self._answer(call, request)

    # -- a request, before it joins a batch -----------------------------------------------------
    def _parse(self, raw: bytes) -> ChatCompletionRequest:
        """The body as a request this server accepts: its model, and within its limits."""
        req = _load_request(raw)
        settings = self.settings
        self.check_model(req.model)
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
        steer = self.steer_of(req)
        telemetry = req.driftlab.wants_telemetry() if req.driftlab is not None else None
        if telemetry is not None and telemetry.kl:
            self._check_kl(steer)
        job = await self._job(req, traced(steer) if telemetry or self.settings.telemetry else steer)
        loop = asyncio.get_running_loop()
        jobs = [job] + [self._sibling(job, k, req) for k in range(1, req.n)]
        for j in jobs:
            j.future, j.loop = loop.create_future(), loop
        return Call(req, job, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), arrived, jobs[1:], steer=steer,
                    telemetry=telemetry)

    def _check_kl(self, steer: Interventions) -> None:
        """422 before any work where this server cannot give a reply's KLs (`protocol.divergence`)."""
        from driftlab.protocol import divergence

        try:
            divergence.require(self.backend, '"telemetry": {"kl": true}')
            divergence.measured_steer(steer)
        except DriftlabError as err:
            raise APIError(422, str(err), param="driftlab.telemetry.kl") from None

    async def _divergence(self, call: Call, reply: Reply) -> dict[str, Any] | None:
        """The reply's KLs where the request asked for them: a job of its own, run once the reply is done
        (the reply read again under three contexts on the model's thread), else None."""
        if call.telemetry is None or not call.telemetry.kl:
            return None
        conversation = [*call.job.conversation, {"role": "assistant", "content": reply.text}]
        end = reply.finish_reason if not call.req.stops() else "length"  # a stop string: no end-of-turn token
        job = Job(conversation, call.job.sampling, 0, call.steer.without("trace"), None, store=False, kl=True, end=end)
        job.future, job.loop = asyncio.get_running_loop().create_future(), asyncio.get_running_loop()
        self.submit(job, call.arrived)
        return await self.wait(job)

    def _sibling(self, job: Job, k: int, req: ChatCompletionRequest) -> Job:
        """Choice k of n: the first choice's job with its own seed (the k-th after the first's)."""
        twin = replace(job, seed=(job.seed + k) % (MAX_SEED + 1), future=None, loop=None, watch=None,
                       aborted=threading.Event(), stopped=threading.Event())
        if stops := req.stops():
            twin.watch = lambda: self.stop_watch(twin, stops)
        return twin

    async def _job(self, req: ChatCompletionRequest, steer: Interventions) -> Job:
        """The request as a batch job under `steer`, with every check that concerns it alone done
        here, before it can share a batch: a bad request fails by itself."""
        conversation = _conversation(req)
        settings = self.settings
        sampling = self.sampling(req, req.new_tokens(min(settings.default_max_tokens, settings.max_tokens_limit)))
        await self._check_prompt(conversation, steer, sampling.max_new_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        job = Job(conversation, sampling, seed, steer, logprobs, store=not self.settings.deterministic)
        if stops := req.stops():
            job.watch = lambda: self.stop_watch(job, stops)
        return job

    def sampling(self, req: SamplingFields, max_new_tokens: int) -> Sampling:
        """The request's sampling (422 if unusable), its logit_bias checked against the vocabulary
        before the request can share a batch."""
        try:
            sampling = req.sampling(max_new_tokens)
            sampling.check_vocab(self.backend.shape.vocab_size)
        except ValidationError as err:  # e.g. a temperature too small to sample with, a logit_bias above 100
            raise invalid(err) from None
        except DriftlabError as err:  # a logit_bias token the model does not have
            raise APIError(422, str(err), param="logit_bias") from None
        if sampling.json_schema is not None:
            self._check_schema(sampling.json_schema)
        return sampling

    def _check_schema(self, schema: str) -> None:
        """422 naming response_format unless this backend can constrain decoding to the schema
        (compiled here, once per schema, before the request can share a batch)."""
        backend = self.backend
        tokenizer, vocab_size = getattr(backend, "tokenizer", None), backend.shape.vocab_size
        if tokenizer is None or vocab_size is None:
            raise APIError(422, "response_format: this backend cannot constrain decoding to JSON; send "
                                '{"type": "text"} or leave it out.', param="response_format")
        try:
            check_schema(tokenizer, vocab_size, backend.eos_ids, schema)
        except DriftlabError as err:
            raise APIError(422, f"response_format: the JSON schema is not usable: {err}",
                           param="response_format") from None

    def check_model(self, model: str) -> None:
        """404 unless `model` is the served name, alone or with a steer: `NAME+SPEC[+SPEC...]`."""
        if model != self.served and not model.startswith(self.served + "+"):
            raise APIError(404, f"Model '{model}' is not served here; this server serves '{self.served}' "
                                f"(steered: '{self.served}+SPEC', e.g. '{self.served}+split-softmax:k=0.8').",
                           param="model", kind="not_found_error")

    def steer_of(self, req: ChatCompletionRequest) -> Interventions:
        """The request's own interventions (its `driftlab.steer`, or a steer named in its model,
        `NAME+SPEC+...`: a harness records the model name with its results), or the server's
        default; head sets by registered name only; the backend must support them (422 otherwise)."""
        named = req.model[len(self.served) + 1 :].split("+") if req.model != self.served else None
        field = req.driftlab.specs() if req.driftlab is not None else None
        if named is not None and field is not None:
            raise APIError(422, "driftlab.steer: the model name already names a steer; give one or the other.",
                           param="driftlab.steer")
        specs, param = (named, "model") if named is not None else (field, "driftlab.steer")
        if specs is None:
            return self.default_steer
        try:
            steer = Interventions.parse(specs, self.request_heads)
            self.backend.capabilities.require(self.backend.name, steer)
        except DriftlabError as err:
            raise APIError(422, f"{param}: {err}", param=param) from None
        return steer

    async def _check_prompt(self, conversation: list[dict[str, str]], steer: Interventions, new_tokens: int) -> None:
        """Tokenise the prompt as the model will see it (on a thread: a long one takes a while)
        and check it fits the context window with the reply."""
        backend = self.backend

        def render() -> int:
            backend.check_steer(conversation, steer)  # a direction for it, a first turn for a floor
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

    def stop_watch(self, job: Job, stops: list[str]) -> Callable[[int], None]:
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
    def submit(self, job: Job, arrived: float) -> None:
        """Queue the job, with its deadline; it is in flight (the drain waits for it) until left."""
        try:
            self.batcher.submit(job)
        except ServerClosing as err:
            raise closing(str(err)) from None
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

    async def wait(self, job: Job) -> Reply:
        """The job's reply, or the API error that says why there is none."""
        try:
            return await job.future
        except ServerClosing as err:
            raise closing(str(err)) from None
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
        cut = self.stop_cut(reply.token_ids, stops)
        if cut is None:
            return replace(reply, finish_reason="stop") if stops and job.stopped.is_set() else reply
        raw, n = cut
        text = cut_at(raw, self.backend.stop_strings).strip()
        return replace(reply, text=text, n_tokens=n, finish_reason="stop", token_ids=reply.token_ids[:n],
                       logprobs=None if reply.logprobs is None else reply.logprobs[:n])

    def stop_cut(self, ids: list[int], stops: list[str]) -> tuple[str, int] | None:
        """The text of `ids` before the first of `stops` and how many tokens cover it (None: no
        stop in it)."""
        raw = self.backend.decode(ids) if stops else ""
        at = find_stop(raw, stops)
        return None if at is None else (raw[:at], self.tokens_covering(ids, at))

    def token_feed(self, job: Job) -> asyncio.Queue[int | None]:
        """The job's tokens, as sampled on the worker thread, on this loop's queue (None: the end)."""
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        job.on_token = lambda tok: job.loop.call_soon_threadsafe(tokens.put_nowait, tok)
        job.future.add_done_callback(lambda _: tokens.put_nowait(None))
        return tokens

    def tokens_covering(self, ids: list[int], chars: int) -> int:
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
        jobs = [call.job, *call.more]
        for job in jobs:  # queued together: n choices share a batch
            self.submit(job, call.arrived)
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))
        try:
            replies = [self._cut_reply(await self.wait(job), job, call.req.stops()) for job in jobs]
            measured = [self.measure(call, reply, await self._divergence(call, reply)) for reply in replies]
        finally:
            watcher.cancel()
            for job in jobs:  # a failed choice: the others stop costing the batch
                job.abort(ClientGone())
            self.metrics.latency.observe(time.monotonic() - call.arrived)
        return JSONResponse(self._completion(replies, call, measured))

    def _stream(self, call: Call):
        """The reply as server-sent events, its tokens passed from the worker thread to this
        loop as they are sampled."""
        from sse_starlette.sse import EventSourceResponse

        job = call.job
        tokens = self.token_feed(job)
        if job.logprobs is not None:
            job.on_logprob = call.scored.append  # on the worker thread, before its token is queued
        self.submit(job, call.arrived)  # before the response starts, so a closing server still answers 503
        text = TextStream(self.backend.decode, self.backend.stop_strings, call.req.stops())
        return EventSourceResponse(self._events(call, tokens, text))

    async def _events(self, call: Call, tokens: asyncio.Queue[int | None],
                      text: TextStream) -> AsyncIterator[dict[str, str]]:
        """The stream's events: a role chunk, text deltas as they become safe to send, then the
        end (see `_last_events`)."""
        try:
            yield {"data": self._chunk(call, {"role": "assistant", "content": ""})}
            pushed = 0
            while (tok := await tokens.get()) is not None:
                pushed += 1
                if delta := text.push(tok):
                    yield {"data": self._chunk(call, {"content": delta}, logprobs=self._stream_logprobs(call, pushed))}
            for event in await self._last_events(call, text):
                yield event
        finally:  # also when the client closed the stream: its row leaves the batch
            call.job.abort(ClientGone())
            self.metrics.latency.observe(time.monotonic() - call.arrived)

    async def _last_events(self, call: Call, text: TextStream) -> list[dict[str, str]]:
        """The end of a stream: the unsent rest of the text, the finish reason, usage if asked
        for, `[DONE]`; or, since the 200 header is sent, the error as an event, then `[DONE]`."""
        try:
            reply = self._cut_reply(await self.wait(call.job), call.job, call.req.stops())
        except APIError as err:
            self.metrics.responses.labels(str(err.status)).inc()
            return [{"data": json.dumps(err.body())}, {"data": "[DONE]"}]
        events = []
        rest, logprobs = text.finish(reply.text), self._stream_logprobs(call, reply.n_tokens)
        if rest or logprobs:
            events.append({"data": self._chunk(call, {"content": rest}, logprobs=logprobs)})
        try:
            measured = self.measure(call, reply, await self._divergence(call, reply))
        except APIError as err:
            self.metrics.responses.labels(str(err.status)).inc()
            return [{"data": json.dumps(err.body())}, {"data": "[DONE]"}]
        events.append({"data": self._chunk(call, {}, reply.finish_reason, extra=self._extension(call, [measured]))})
        opts = call.req.stream_options
        if opts is not None and opts.include_usage:
            events.append({"data": json.dumps({"id": call.cid, "object": "chat.completion.chunk",
                                               "created": call.created, "model": self.served, "choices": [],
                                               "usage": _usage(reply)})})
        events.append({"data": "[DONE]"})
        return events

    def _chunk(self, call: Call, delta: dict[str, Any], finish: str | None = None,
               logprobs: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> str:
        """One `chat.completion.chunk` event's data (`extra`: the driftlab field of the last one)."""
        chunk = {"id": call.cid, "object": "chat.completion.chunk", "created": call.created, "model": self.served,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
        if extra is not None:
            chunk["driftlab"] = extra
        return json.dumps(chunk)

    def _stream_logprobs(self, call: Call, upto: int) -> dict[str, Any] | None:
        """The log-probs of the tokens up to `upto` that no chunk has carried yet (None without
        logprobs, or when there are none): each chunk carries those of the tokens its text
        came from, so a stream's log-probs add up to the plain reply's."""
        if call.job.logprobs is None or upto <= call.sent:
            return None
        entries, call.sent = call.scored[call.sent : upto], upto
        return {"content": [self._token_logprob(t.token_id, t.logprob, t.top) for t in entries]}

    def measure(self, call: Call, reply: Reply, kl: dict[str, Any] | None = None) -> dict[str, Any]:
        """The reply's drift telemetry (`serve.telemetry.summary`; its KLs where asked), also observed in /metrics."""
        conversation = call.job.conversation
        measured = summary(reply, conversation, layers=call.telemetry is not None and call.telemetry.layers)
        if kl is not None:
            measured["kl"] = kl
        self.metrics.drift(self.labels(system_of(conversation)), measured)
        return measured

    def _extension(self, call: Call, measured: list[dict[str, Any]]) -> dict[str, Any]:
        """The reply's `driftlab` field: the steer applied (as the request asked), `when-drifting`'s
        decision where it gated the steer, and the telemetry of each choice if asked for (one object
        for one choice, else a list)."""
        out: dict[str, Any] = {"steer": call.steer.specs()}
        if any(m["gate"] is not None for m in measured):  # when-drifting: whether each reply was steered
            out["gate"] = measured[0]["gate"] if len(measured) == 1 else [m["gate"] for m in measured]
        if call.telemetry is not None:
            out["telemetry"] = measured[0] if len(measured) == 1 else measured
        return out

    def _completion(self, replies: list[Reply], call: Call, measured: list[dict[str, Any]]) -> dict[str, Any]:
        """The `chat.completion` body (one choice per reply), with log-probs if asked for, the
        steer that was applied and, if asked for, the drift telemetry."""
        choices = []
        for i, reply in enumerate(replies):
            choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": reply.text},
                                      "finish_reason": reply.finish_reason, "logprobs": None}
            if reply.logprobs is not None:
                choice["logprobs"] = {"content": [self._token_logprob(t.token_id, t.logprob, t.top)
                                                  for t in reply.logprobs]}
            choices.append(choice)
        usage = _usage(replies[0])
        usage["completion_tokens"] = sum(r.n_tokens for r in replies)  # the prompt is read once for all n
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": call.cid, "object": "chat.completion", "created": call.created, "model": self.served,
                "choices": choices, "usage": usage, "driftlab": self._extension(call, measured)}

    def _token_logprob(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        """One token's log-prob entry in OpenAI's form (text with special tokens, and its bytes)."""
        def entry(i: int, lp: float) -> dict[str, Any]:
            tok = self.backend.decode([i], skip_special=False)
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

        return {**entry(token_id, logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}


def _load_request(raw: bytes) -> ChatCompletionRequest:
    """The body as a chat request (400 not JSON, 422 a wrong or unsupported field), before any
    check that depends on this server."""
    req = load_body(raw, ChatCompletionRequest, unsupported_field)
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


async def _watch_disconnect(request: Request, jobs: list[Job]) -> None:
    """Abort the request's jobs when its client closes the connection (the body is read: the
    next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.abort(ClientGone())


def _usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.n_prompt_tokens, "completion_tokens": reply.n_tokens,
            "total_tokens": reply.n_prompt_tokens + reply.n_tokens}
