"""Any OpenAI-compatible chat server as a backend: vLLM, SGLang, llama.cpp, hosted APIs, `driftlab serve`.

Why this exists: the models people deploy (a 70B behind vLLM, a hosted API) are where drift
matters, and they are only reachable over HTTP. The backend speaks `/v1/chat/completions`
through the official `openai` SDK, with

* bounded concurrency (`Runtime.concurrency` requests in flight),
* a per-request timeout, and retries with exponential backoff and full jitter on 408/409/429,
  5xx, connection errors, timeouts and malformed replies (honouring `Retry-After`); other
  4xx are the caller's mistake and fail at once, with the server's message,
* a request log (`requests.jsonl` in the run directory): every finished request with its
  reply, usage and latency. A resumed run answers logged requests from it, so it never
  sends a finished request twice, even one whose batch was cut short by a kill.

Only interventions that edit the conversation (system-prompt repetition) work remotely;
attention interventions and classifier-free guidance need the model's internals (CFG mixes
full next-token distributions at every step, which chat APIs do not expose) and are refused
by `Capabilities`. Log-likelihoods (MMLU) use the first generated position's top-20
log-probabilities, so only single-token continuations can be scored.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from driftlab.chat.base import (
    Capabilities,
    ChatRequest,
    Conversation,
    LogLikelihood,
    Reply,
    Sampling,
    validate_conversation,
)
from driftlab.chat.spec import Runtime
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

REQUEST_LOG = "requests.jsonl"
TOP_LOGPROBS = 20  # the most OpenAI's API returns per position
RETRY_STATUS = frozenset({408, 409, 429})  # plus every 5xx


VLLM_EXTENSIONS = ("ignore_eos", "top_k", "min_p", "repetition_penalty")  # request fields OpenAI's API lacks


class RequestLog:
    """Finished requests of a run, keyed by a hash of everything that determines the reply.

    Appended line by line (flushed, so a kill -9 loses at most the line being written; a
    torn last line is ignored on reading). Only the run directory's locked writer uses it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                    self.done[entry["key"]] = entry["response"]
                except (ValueError, KeyError, TypeError):
                    continue  # a torn tail after a kill: that request is simply sent again
        self._file = None

    @staticmethod
    def key(body: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def add(self, key: str, body: dict[str, Any], response: dict[str, Any], meta: dict[str, Any]) -> None:
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        line = {"key": key, "request": body, "response": response, **meta}
        self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._file.flush()
        self.done[key] = response

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class OpenAIChatBackend:
    """A model behind an OpenAI-compatible `/v1/chat/completions` endpoint."""

    capabilities = Capabilities(interventions=frozenset({"spr"}), loglikelihood=True)

    def __init__(
        self,
        model: str,
        runtime: Runtime = Runtime(),
        *,
        log_dir: str | Path | None = None,
        backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        try:
            import openai
        except ImportError as err:  # a core dependency; only a broken install lacks it
            raise DriftlabError("The openai package is missing.", hint="pip install -e . (driftlab needs openai).") from err
        self._openai = openai
        self.model = model
        self.name = f"openai:{model}"
        self.runtime = runtime
        self.base_url = runtime.base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        key = os.environ.get(runtime.api_key_env)
        if key is None and runtime.base_url is None and "OPENAI_BASE_URL" not in os.environ:
            raise DriftlabError(
                f"No API key: ${runtime.api_key_env} is not set.",
                hint=f"export {runtime.api_key_env}=..., or name another variable with --api-key-env, "
                "or point --base-url at your own server.",
            )
        self._api_key = key or "EMPTY"  # local servers (vLLM, llama.cpp) accept any key unless they set one
        self.backoff = backoff
        self.log = RequestLog(Path(log_dir) / REQUEST_LOG) if log_dir is not None else None
        self.sent = 0  # requests that reached the network (not answered from the log)

    # -- ChatBackend --------------------------------------------------------------------------
    def generate(self, request: ChatRequest) -> list[Reply]:
        iv = request.interventions
        self.capabilities.require(self.name, iv)
        if hooks := request.local_only():
            raise DriftlabError(f"{self.name} does not take {', '.join(hooks)} (a local model's decode-loop hooks).")
        seeds = request.row_seeds()
        bodies = [
            self._body(iv.model_view(conv), request.sampling, seed, request.logprobs)
            for conv, seed in zip(request.conversations, seeds, strict=True)
        ]
        return [_reply(r) for r in self._run(bodies)]

    def loglikelihood(
        self,
        contexts: Sequence[Conversation],
        continuations: Sequence[str],
        interventions: Interventions = Interventions(),
        *,
        batch_size: int = 8,  # accepted for the ScoringBackend signature; concurrency bounds the work
    ) -> list[LogLikelihood]:
        """log p(continuation | context) from the first reply position's top-20 log-probabilities.

        A continuation matches a returned token that reads the same once surrounding spaces
        are stripped ("B" and " B"); the best match counts. One not among the top 20 gets
        the 20th log-probability, an upper bound of its own. Only one-token continuations
        (a multiple-choice letter) can be scored this way.
        """
        if len(contexts) != len(continuations):
            raise DriftlabError(f"{len(contexts)} contexts but {len(continuations)} continuations.")
        self.capabilities.require(self.name, interventions)
        greedy = Sampling(max_new_tokens=1, temperature=0.0)
        bodies: dict[str, dict[str, Any]] = {}
        keys = []
        for i, (conv, cont) in enumerate(zip(contexts, continuations, strict=True)):
            validate_conversation(conv, i)
            if not cont.strip() or len(cont.strip().split()) > 1:
                raise DriftlabError(
                    f"Continuation {i} ({cont!r}) is not a single word.",
                    hint="A remote server's log-probabilities only cover the first reply token.",
                )
            body = self._body(interventions.model_view(conv), greedy, 0, TOP_LOGPROBS)
            keys.append(RequestLog.key(body))
            bodies.setdefault(keys[-1], body)
        answers = dict(zip(bodies, self._run(list(bodies.values())), strict=True))
        out = []
        for key, cont in zip(keys, continuations, strict=True):
            top = answers[key].get("top_logprobs") or []
            if not top:
                raise DriftlabError(
                    f"{self.base_url} returned no log-probabilities.",
                    hint="The server must support `logprobs` and `top_logprobs` (vLLM, SGLang and driftlab serve do).",
                )
            matches = [lp for tok, lp in top if tok.strip() == cont.strip()]
            best = max(matches) if matches else min(lp for _, lp in top)
            out.append(LogLikelihood(best, 1, bool(matches) and best >= max(lp for _, lp in top)))
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "backend": "openai", "model": self.model, "base_url": self.base_url,
                "api_key_env": self.runtime.api_key_env, "concurrency": self.runtime.concurrency}

    def close(self) -> None:
        if self.log is not None:
            self.log.close()

    # -- requests -----------------------------------------------------------------------------
    def _body(self, conv: Conversation, sampling: Sampling, seed: int, logprobs: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in conv],
            "max_tokens": sampling.max_new_tokens,
            "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "top_p": 1.0 if sampling.greedy else sampling.top_p,
            "seed": int(seed),
        }
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension; benchmarks only
        # Sent only where they change something, so a plain OpenAI endpoint (which lacks top_k,
        # min_p and repetition_penalty, vLLM's extensions) and recorded request keys are as before.
        if sampling.frequency_penalty:
            body["frequency_penalty"] = sampling.frequency_penalty
        if sampling.presence_penalty:
            body["presence_penalty"] = sampling.presence_penalty
        if sampling.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
        if sampling.repetition_penalty != 1.0:
            body["repetition_penalty"] = sampling.repetition_penalty
        if not sampling.greedy and sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if not sampling.greedy and sampling.min_p > 0.0:
            body["min_p"] = sampling.min_p
        if sampling.json_schema is not None:  # the server constrains (OpenAI, vLLM and driftlab serve do)
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "reply", "schema": json.loads(sampling.json_schema)}}
        return body

    def _run(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Answer every body, from the log or the server, at most `concurrency` at a time."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._gather(bodies))
        # Called from inside an event loop (a notebook): run ours on a thread of its own.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._gather(bodies)).result()

    async def _gather(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        client = self._openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self._api_key, timeout=self.runtime.timeout, max_retries=0
        )
        gate = asyncio.Semaphore(self.runtime.concurrency)
        try:
            tasks = [asyncio.ensure_future(self._one(client, gate, body)) for body in bodies]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:  # a failed request ends the batch; finished ones are in the log
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            await client.close()

    async def _one(self, client, gate: asyncio.Semaphore, body: dict[str, Any]) -> dict[str, Any]:
        key = RequestLog.key(body)
        if self.log is not None and key in self.log.done:
            return self.log.done[key]
        openai = self._openai
        extra = {k: body[k] for k in VLLM_EXTENSIONS if k in body}  # not in the SDK's signature
        kwargs = {k: v for k, v in body.items() if k not in extra}
        async with gate:
            for attempt in range(self.runtime.max_retries + 1):
                start = time.monotonic()
                wait = None
                try:
                    completion = await client.chat.completions.create(**kwargs, extra_body=extra or None)
                    response = _parse(completion)
                except openai.APIStatusError as err:
                    if err.status_code not in RETRY_STATUS and err.status_code < 500:
                        raise DriftlabError(
                            f"{self.base_url} refused the request ({err.status_code}): {_message(err)}",
                            hint=_status_hint(err.status_code),
                        ) from None
                    problem, wait = f"HTTP {err.status_code}: {_message(err)}", _retry_after(err)
                except openai.APITimeoutError:
                    problem = f"no answer within {self.runtime.timeout:g} s (--timeout)"
                except (openai.APIConnectionError, openai.APIResponseValidationError, _Malformed) as err:
                    problem = f"{type(err).__name__}: {err}"
                else:
                    self.sent += 1
                    if self.log is not None:
                        self.log.add(key, body, response,
                                     {"elapsed_s": round(time.monotonic() - start, 3), "attempts": attempt + 1})
                    return response
                if attempt == self.runtime.max_retries:
                    raise DriftlabError(
                        f"{self.base_url} failed {attempt + 1} times; last: {problem}",
                        hint="Check that the server is up and not overloaded (lower --concurrency, or raise "
                        "--timeout for slow replies); re-running the same command resumes without re-sending "
                        "finished requests.",
                    )
                first, cap = self.backoff
                delay = random.uniform(0, min(cap, first * 2**attempt))  # exponential backoff, full jitter
                await asyncio.sleep(max(delay, wait or 0.0))
        raise AssertionError("unreachable")


class _Malformed(Exception):
    """A 2xx reply that is not a usable chat completion (retried like a transient error)."""


def _parse(completion: Any) -> dict[str, Any]:
    """The parts of a chat completion driftlab records; anything unusable raises _Malformed."""
    choices = getattr(completion, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise _Malformed(f"no choices in the reply: {str(completion)[:200]!r}")
    choice = choices[0]
    text = getattr(getattr(choice, "message", None), "content", None)
    if not isinstance(text, str):
        raise _Malformed(f"the reply has no text content: {str(choice)[:200]!r}")
    usage = getattr(completion, "usage", None)
    top: list[list[Any]] = []
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if content:
        top = [[t.token, t.logprob] for t in (content[0].top_logprobs or [])]
        if not top:
            top = [[content[0].token, content[0].logprob]]
    return {
        "text": text,
        "finish_reason": "length" if choice.finish_reason == "length" else "stop",
        "completion_tokens": getattr(usage, "completion_tokens", None),
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "top_logprobs": top,
    }


def _reply(response: dict[str, Any]) -> Reply:
    return Reply(
        text=response["text"].strip(),  # as the local backend: surrounding whitespace is not part of a turn
        n_tokens=int(response.get("completion_tokens") or 0),
        finish_reason=response["finish_reason"],
        n_prompt_tokens=int(response.get("prompt_tokens") or 0),
    )


def _message(err: Any) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])[:300]
    return str(getattr(err, "message", err))[:300]


def _retry_after(err: Any) -> float | None:
    value = getattr(getattr(err, "response", None), "headers", {}).get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and 0 <= seconds <= 600 else None


def _status_hint(status: int) -> str:
    return {
        401: "The server wants an API key: set it in the variable named by --api-key-env.",
        403: "The API key is not allowed to use this model.",
        404: "Check the model name after openai: (see the server's /v1/models) and --base-url (ends in /v1).",
    }.get(status, "The request itself was refused; fix it rather than retrying.")
