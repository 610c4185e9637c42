"""The wire of `driftlab serve`'s routes: errors in OpenAI's shape, bodies read within limits,
text streamed without ever passing a stop string. Shared by the chat and completions routes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


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
                 stops: Sequence[str] = (), *, strip: bool = True) -> None:
        self.decode = decode  # token ids -> text, special tokens skipped (TokenBackend.decode)
        self.strip = strip  # chat replies are stripped; raw completions are sent as written
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
        text = raw.lstrip() if self.strip else raw
        if text.endswith("\ufffd") and not self.done:
            return ""
        if self.done:
            safe = cut_at(text, self.stop_strings)
        else:
            safe = text[: max(0, len(text) - self.hold)] if self.hold else text
        safe = safe.rstrip() if self.strip else safe
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, final: str) -> str:
        delta = final[len(self.sent) :] if final.startswith(self.sent) else ""
        self.sent = final
        return delta


def parse_json(raw: bytes) -> Any:
    """The body as JSON (400 when it is not, or nests too deeply)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, "The body nests JSON too deeply to be a request.") from None
    except ValueError as err:
        raise APIError(400, f"The body is not valid JSON: {err}.") from None


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first of `stops` begins in `text` (None: nowhere)."""
    return min((i for s in stops if (i := text.find(s)) >= 0), default=None)


def cut_at(text: str, stops: Sequence[str]) -> str:
    at = find_stop(text, stops)
    return text if at is None else text[:at]


def closing(message: str) -> APIError:
    return APIError(503, message, kind="server_error", headers={"Retry-After": "5"})


def invalid(err: ValidationError) -> APIError:
    """422 naming the first invalid field, e.g. `messages.0.role: Input should be ...`; a check
    across fields says which field first ("stream: ...")."""
    e = err.errors()[0]
    param, msg = ".".join(str(p) for p in e["loc"]), e["msg"].removeprefix("Value error, ")
    if not param:
        return APIError(422, msg, param=msg.split(":", 1)[0] if re.match(r"[\w.]+: ", msg) else None)
    return APIError(422, f"{param}: {msg}", param=param)


async def read_body(request: Any, limit: int) -> bytes:
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


def load_body(raw: bytes, schema: type[M], refused: Callable[[Any], str | None]) -> M:
    """The body as `schema`: 400 when it is not JSON; 422 for a field driftlab would have to
    ignore although it changes the reply (`refused` names it) or for an invalid one."""
    data = parse_json(raw)
    if (name := refused(data)) is not None:
        raise APIError(422, f"{name}: not supported by driftlab serve (it would be ignored, which changes "
                            "what the reply means); leave it out or send its neutral value.", param=name)
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise invalid(err) from None
