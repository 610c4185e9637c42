"""Concurrent HTTP requests in, batched decode calls out.

The local backend decodes a batch of conversations in one loop, and a batch of 32 costs
little more per step than a batch of one on most hardware. The batcher is a queue plus
one worker thread that owns the backend: it takes the first waiting job, gathers more for
at most `max_wait_s` (up to `max_batch_size`), groups them by what a `ChatRequest` shares
(sampling, interventions, logprobs) and runs each group as one `generate` call. Requests
that arrive while a batch decodes form the next batch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from driftlab.chat.base import ChatBackend, ChatRequest, Conversation, Reply, Sampling
from driftlab.steering.interventions import Interventions


class ServerClosing(Exception):
    """The server shut down before this request's batch started."""


@dataclass
class Job:
    conversation: Conversation
    sampling: Sampling
    seed: int
    interventions: Interventions
    logprobs: int | None
    future: asyncio.Future | None = None  # set by the server on its event loop
    loop: asyncio.AbstractEventLoop | None = None
    on_token: Callable[[int], None] | None = None  # called on the worker thread
    queued_at: float = field(default_factory=time.monotonic)

    def group(self) -> tuple[Any, ...]:
        return (self.sampling, tuple(self.interventions.specs()), self.logprobs)

    def resolve(self, result: Reply | BaseException) -> None:
        def _set() -> None:
            if self.future.done():  # the client went away
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(_set)


class Batcher:
    """The one thread that calls the backend; everything else talks to it through a queue."""

    def __init__(self, backend: ChatBackend, *, max_batch_size: int = 32, max_wait_s: float = 0.01) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._queue: queue.Queue[Job] = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="driftlab-batcher", daemon=True)
        self.batches: list[int] = []  # sizes of the generate calls made (for tests and /health)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closing.is_set():
            raise ServerClosing("the server is shutting down")
        self._queue.put(job)

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float = 60.0) -> None:
        """Finish the batch being decoded, refuse what is still queued, stop the thread."""
        self._closing.set()
        self._thread.join(timeout)
        while True:
            try:
                self._queue.get_nowait().resolve(ServerClosing("the server shut down before this request ran"))
            except queue.Empty:
                break

    # -- worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._closing.is_set():
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            groups: dict[tuple[Any, ...], list[Job]] = {}
            for job in batch:
                groups.setdefault(job.group(), []).append(job)
            for jobs in groups.values():
                self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        live = [j for j in jobs if not j.future.done()]  # cancelled by a client that left
        if not live:
            return
        callbacks = [j.on_token for j in live]

        def on_token(row: int, token: int) -> None:
            if callbacks[row] is not None:
                callbacks[row](token)

        request = ChatRequest(
            [j.conversation for j in live], live[0].sampling, seeds=[j.seed for j in live],
            interventions=live[0].interventions, logprobs=live[0].logprobs,
            on_token=on_token if any(callbacks) else None,
        )
        self.batches.append(len(live))
        try:
            replies = self.backend.generate(request)
        except BaseException as err:  # noqa: BLE001 - every waiting client must hear about it
            for j in live:
                j.resolve(err)
            return
        for j, reply in zip(live, replies, strict=True):
            j.resolve(reply)
