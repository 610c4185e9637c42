"""`POST /v1/completions`: raw text in, its continuation and log-probabilities out.

OpenAI's legacy completions as vLLM serves them, which is what lm-evaluation-harness's
`local-completions` model needs for every log-likelihood task: `prompt` (a string, strings,
token ids or lists of them), `max_tokens` (0 with `echo`: score the prompt only), `echo`
(the prompt's text and its tokens' log-probabilities first), `logprobs` (k alternatives per
token: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), `temperature`, `top_p`,
`seed`, `n`, `stop`, `stream`. The text is returned as the model wrote it (not stripped):
a harness compares continuations character by character.

The `driftlab` field steers as in chat completions, plus where the steer's system span is in
raw text: `"system": {"chars": [start, end]}`, `{"until": MARKER}`, `"chat"` (the default:
the system message where the model's chat template puts it, so a prompt a client rendered
with the template is steered as its conversation would be) or `"none"`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from driftlab.chat.base import MAX_SEED, Rendered, Reply, Sampling
from driftlab.chat.text import SpanError, SystemSpan, TokenScores, encode, from_ids
from driftlab.errors import DriftlabError
from driftlab.serve.batcher import Job
from driftlab.serve.schema import MAX_PROMPTS, CompletionRequest, unsupported_field
from driftlab.serve.wire import (
    APIError,
    ClientGone,
    TextStream,
    closing,
    cut_at,
    load_body,
    read_body,
)

if TYPE_CHECKING:
    from driftlab.serve.app import ServerState


class Completions:
    """The route and its steps, on the server's shared state (batcher, limits, auth, metrics)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def route(self, request: Request):
        # Checks, then every row of every prompt queued at once, then one response.
        state = self.state
        if state.drain.draining:
            raise closing("The server is shutting down and takes no new requests; retry in a moment.")
        arrived = time.monotonic()
        req = self._parse(await read_body(request, state.settings.max_body_bytes))
        steer = state.steer_of(req)
        _text_can_take(state.backend, steer)
        prompts = await asyncio.to_thread(self._encode, req)
        rows = [await self._jobs(req, prompt, i, steer) for i, prompt in enumerate(prompts)]
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return self._stream(req, prompts[0], rows[0][0][0], cid, created, arrived)
        jobs = [job for gens, scored in rows for job in [*gens, scored] if job is not None]
        try:
            for job in jobs:  # all queued at once: the batcher decodes them together
                state.submit(job, arrived)
            choices = []
            for prompt, (gens, scored) in zip(prompts, rows, strict=True):
                prompt_scores = await state.wait(scored) if scored else None
                for job in gens:
                    reply = await state.wait(job) if job is not None else None
                    choices.append(self._choice(len(choices), req, prompt, prompt_scores, reply))
        finally:  # one failed row: the others stop costing the batch
            for job in jobs:
                job.abort(ClientGone())
            state.metrics.latency.observe(time.monotonic() - arrived)
        return {"id": cid, "object": "text_completion", "created": created, "model": state.served,
                "choices": choices, "usage": _usage(prompts, choices), "driftlab": {"steer": steer.specs()}}

    # -- checks ---------------------------------------------------------------------------------
    def _parse(self, raw: bytes) -> CompletionRequest:
        req = load_body(raw, CompletionRequest, _refused)
        state = self.state
        state.check_model(req.model)
        if len(req.prompts()) > MAX_PROMPTS:
            raise APIError(422, f"prompt: {len(req.prompts())} prompts, at most {MAX_PROMPTS}.", param="prompt")
        if req.max_tokens > state.settings.max_tokens_limit:
            raise APIError(422, f"max_tokens: {req.max_tokens} is above this server's limit of "
                                f"{state.settings.max_tokens_limit}.", param="max_tokens")
        return req

    def _encode(self, req: CompletionRequest) -> list[Rendered]:
        """Each prompt as the model's tokens with its system span; each must fit the context
        window with `max_tokens` (422 naming the prompt otherwise)."""
        backend, out = self.state.backend, []
        span = req.driftlab.span() if req.driftlab is not None else SystemSpan(chat=True)
        for i, p in enumerate(req.prompts()):
            param = "prompt" if len(req.prompts()) == 1 else f"prompt.{i}"
            try:
                if isinstance(p, str):
                    p.encode("utf-8")
                rendered = encode(backend, p, span) if isinstance(p, str) else from_ids(backend, p, span)
            except UnicodeEncodeError:
                raise APIError(400, f"{param} holds a lone UTF-16 surrogate; send valid Unicode text.",
                               param=param) from None
            except SpanError as err:
                raise APIError(422, f"driftlab.system: {err}", param="driftlab.system") from None
            except DriftlabError as err:
                raise APIError(422, f"{param}: {err}", param=param) from None
            limit = backend.shape.max_context
            if limit and len(rendered.ids) + req.max_tokens > limit:
                raise APIError(422, f"{param}: {len(rendered.ids)} tokens and max_tokens {req.max_tokens}: together "
                                    f"above the model's context window of {limit}.", param=param)
            out.append(rendered)
        return out

    async def _jobs(self, req: CompletionRequest, prompt: Rendered, index: int, steer) -> tuple[list[Job], Job | None]:
        """The generation jobs of one prompt (n of them, each with its own seed; none under
        max_tokens 0) and, with `echo` and `logprobs`, the job that scores the prompt."""
        state, loop = self.state, asyncio.get_running_loop()
        store = not state.settings.deterministic
        base = req.seed if req.seed is not None else secrets.randbits(62)
        gens: list[Job] = []
        if req.max_tokens > 0:
            sampling = state.sampling(req, req.max_tokens)
            for k in range(req.n):
                job = Job(prompt, sampling, (base + index * req.n + k) % (MAX_SEED + 1), steer, req.logprobs,
                          store=store)
                if stops := req.stop:
                    job.watch = (lambda j, s: lambda: state.stop_watch(j, s))(job, stops)
                gens.append(job)
        else:
            gens = [None] * req.n  # type: ignore[list-item]
        scored = None
        if req.echo and req.logprobs is not None:
            if not state.backend.capabilities.prompt_scores:
                raise APIError(422, f"echo with logprobs scores the prompt's tokens, which {state.backend.name} does not; "
                                    "ask without echo, or serve the transformers engine.", param="echo")
            scored = Job(prompt, Sampling(max_new_tokens=1), 0, steer, req.logprobs, score=True)
        for job in [*gens, scored]:
            if job is not None:
                job.future, job.loop = loop.create_future(), loop
        return gens, scored

    # -- the answer -------------------------------------------------------------------------------
    def _choice(self, index: int, req: CompletionRequest, prompt: Rendered, scores: TokenScores | None,
                reply: Reply | None) -> dict[str, Any]:
        """One choice: the (echoed prompt and) continuation, its finish reason and log-probs."""
        text, ids, finish, entries = self._continuation(reply, req.stop or [])
        choice: dict[str, Any] = {"index": index, "text": (prompt.text if req.echo else "") + text,
                                  "finish_reason": finish, "logprobs": None}
        if req.logprobs is not None:
            rows: list[tuple[int, float | None, list[tuple[int, float]] | None]] = []
            if req.echo:
                rows.append((prompt.ids[0], None, None))
                rows += [(e.token_id, e.logprob, e.top) for e in scores.entries()]
            rows += [(e.token_id, e.logprob, e.top) for e in entries]
            choice["logprobs"] = self._logprobs(rows)
        choice["_tokens"] = len(ids)
        return choice

    def _continuation(self, reply: Reply | None, stops: list[str]):
        """The generated text as the model wrote it, cut before the first stop string (the
        reply's tokens and log-probs cut with it)."""
        if reply is None:
            return "", [], "length", []
        state = self.state
        ids, entries, finish = reply.token_ids, reply.logprobs or [], reply.finish_reason
        if (cut := state.stop_cut(ids, stops)) is not None:
            raw, n = cut
            ids, entries, finish = ids[:n], entries[:n], "stop"
        else:
            raw = state.backend.decode(ids)
            if reply.end is not None:  # the end-of-turn token is scored, not written (vLLM's reading)
                entries = [*entries, reply.end]
        return cut_at(raw, state.backend.stop_strings), ids, finish, entries

    def _logprobs(self, rows) -> dict[str, Any]:
        """OpenAI's completions log-probs: token strings, their log-probs, the alternatives as
        {token: logprob} (the chosen token among them, as vLLM does) and character offsets."""
        decode = self.state.backend.decode
        tokens = [decode([t], skip_special=False) for t, _, _ in rows]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        tops: list[dict[str, float] | None] = []
        for (_, lp, top), tok in zip(rows, tokens, strict=True):
            if lp is None:
                tops.append(None)
                continue
            alts = {decode([i], skip_special=False): v for i, v in top or []}
            alts.setdefault(tok, lp)
            tops.append(alts)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows], "top_logprobs": tops,
                "text_offset": offsets}

    def _stream(self, req: CompletionRequest, prompt: Rendered, job: Job | None, cid: str, created: int,
                 arrived: float):
        """One prompt's continuation as server-sent `text_completion` chunks (text as it is safe
        to send, never past a stop string), then the finish reason, usage if asked, `[DONE]`."""
        from sse_starlette.sse import EventSourceResponse

        if job is None or req.echo:
            raise APIError(422, "stream: stream a continuation (max_tokens >= 1) without echo.", param="stream")
        state = self.state
        tokens = state.token_feed(job)
        state.submit(job, arrived)
        text = TextStream(state.backend.decode, state.backend.stop_strings, req.stop or [], strip=False)

        def chunk(delta: str, finish: str | None = None, **extra) -> dict[str, str]:
            return {"data": json.dumps({"id": cid, "object": "text_completion", "created": created,
                                        "model": state.served, "choices": [{"index": 0, "text": delta,
                                        "finish_reason": finish, "logprobs": None}], **extra})}

        async def events() -> AsyncIterator[dict[str, str]]:
            try:
                while (tok := await tokens.get()) is not None:
                    if delta := text.push(tok):
                        yield chunk(delta)
                try:
                    reply = await state.wait(job)
                except APIError as err:
                    yield {"data": json.dumps(err.body())}
                    yield {"data": "[DONE]"}
                    return
                final, ids, finish, _ = self._continuation(reply, req.stop or [])
                yield chunk(text.finish(final), finish)
                if req.stream_options is not None and req.stream_options.include_usage:
                    usage = {"prompt_tokens": len(prompt.ids), "completion_tokens": len(ids),
                             "total_tokens": len(prompt.ids) + len(ids)}
                    yield {"data": json.dumps({"id": cid, "object": "text_completion", "created": created,
                                               "model": state.served, "choices": [], "usage": usage})}
                yield {"data": "[DONE]"}
            finally:
                job.abort(ClientGone())
                state.metrics.latency.observe(time.monotonic() - arrived)

        return EventSourceResponse(events())


class Tokenizer:
    """vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`: a harness (lm-eval's remote
    tokenizer) counts context tokens with the served model's own tokenizer, nothing local."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def info(self) -> dict[str, Any]:
        # The special tokens and chat template a client needs to build prompts as the server reads them.
        tok, backend = self.state.backend.tokenizer, self.state.backend
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": backend.shape.max_context}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        # {"prompt": TEXT, "add_special_tokens": true} -> {"tokens", "count", "max_model_len"}.
        body = await self._body(request, TokenizeRequest)
        ids = await asyncio.to_thread(self.state.backend.tokenizer, body.prompt,
                                      add_special_tokens=body.add_special_tokens)
        tokens = list(ids["input_ids"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.state.backend.shape.max_context}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        # {"tokens": [ids]} -> {"prompt": TEXT}; ids outside the vocabulary are a 422.
        body = await self._body(request, DetokenizeRequest)
        try:
            rendered = from_ids(self.state.backend, body.tokens) if body.tokens else None
        except DriftlabError as err:
            raise APIError(422, f"tokens: {err}", param="tokens") from None
        return {"prompt": rendered.text if rendered else ""}

    async def _body(self, request: Request, schema: type[BaseModel]) -> Any:
        return load_body(await read_body(request, self.state.settings.max_body_bytes), schema, lambda data: None)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: list[int]


def _usage(prompts: list[Rendered], choices: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(len(p.ids) for p in prompts)
    completion = sum(c.pop("_tokens") for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _refused(data: Any) -> str | None:
    """What a text completion cannot honour: chat's unsupported fields, and `suffix` (insertion)."""
    name = unsupported_field(data)
    if name is None and isinstance(data, dict) and data.get("suffix") not in (None, ""):
        name = "suffix"
    return name


def _text_can_take(backend, steer) -> None:
    """A raw text has no system message and no first turn: a vector or cap steer needs the directions'
    axis, and a pi floor or `when-drifting` cannot act (422 for this request alone)."""
    try:
        backend.residual_rows([None], steer)
        if kind := next((k for k in ("pi-floor", "when-drifting") if k in steer.kinds), None):
            raise DriftlabError(f"{kind} reads the attention of a conversation's first turn; a text completion "
                                "has none.", hint="Use /v1/chat/completions.")
    except DriftlabError as err:
        raise APIError(422, f"driftlab.steer: {err}", param="driftlab.steer") from None
