"""Concurrent HTTP requests in, batched decode calls out.

The local backend decodes a batch of conversations in one loop, and a batch of 32 costs
little more per step than a batch of one on most hardware. The batcher is a bounded queue
plus one worker thread that owns the backend: it takes the first waiting job, gathers more
for at most `max_wait_s` (up to `max_batch_size`), and runs the jobs that share what a
`ChatRequest` shares (`Job.group`: sampling but for the token limit, interventions,
logprobs) as one `generate` call (or one `driftlab.chat.text.score` call for prompts to score, or one
`driftlab.protocol.divergence.divergences` call for replies to read again for their KLs).

Continuous batching (the default, `continuous=True`; vLLM's and Orca's iteration-level
scheduling): a request that arrives while a batch decodes joins it at the next step, when it
shares the batch's lane (`Job.lane`: the sampling but for the token limit, log-probs, prompt
tracing; every steer but CFG and the pi floor is per-row data, telemetry's pi trace too) and is first in line
(`ChatRequest.admit`); a row that finishes leaves it (its reply is handed over at once). So a
short request no longer waits for the longest row of the batch before it. A request of another
lane waits until the running batch drains, and stops the batch admitting more (first come,
first served: no lane starves).
With `continuous=False` (static batching) the requests that arrive while a batch decodes form
the next batch. The backend decides which batches can take rows (a dynamic cache without prefill
traces, CFG, floors, grammars or penalties: `Decoding.admissible`); others run as static ones.

A job belongs to one client, and nothing one client does reaches another (vLLM's rule):
- a job whose client left, timed out or was drained is *aborted*: it is skipped if still
  queued, and its row stops at the next decode step if it is running (`ChatRequest.cancelled`);
  a job whose reply reached one of its stop strings (`Job.stopped`) ends the same way, and the
  server cuts its reply at the stop;
- a batch that fails is re-run one job at a time, so an error fails only the job that causes it
  (a stream that already sent tokens fails with it: a re-run could contradict them);
- the queue is bounded (`QueueFull`, HTTP 429) and no record of past work grows: the batch
  sizes kept for tests and `/health` are the last `HISTORY` only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from driftlab.chat.base import ChatBackend, ChatRequest, Conversation, Rendered, Reply, Sampling, TokenLogprob
from driftlab.chat.text import TokenScores, score
from driftlab.steering.interventions import Interventions

log = logging.getLogger("driftlab.serve")
HISTORY = 1024  # batch sizes remembered (a deque: a server's memory must not grow with its uptime)
BATCH_WIDE = frozenset({"cfg", "pi-floor"})  # steers whose rows cannot join another steer's batch


class ServerClosing(Exception):
    """The server shut down (or is draining) before this request could finish."""


class QueueFull(Exception):
    """As many requests are waiting as the server accepts (`--max-queue`)."""


@dataclass(eq=False)  # a job is itself, not its fields (kept in sets)
class Job:
    """One row of work: a conversation (or raw prompt) to continue, or, with `score`, a raw
    prompt whose tokens' log-probabilities are wanted (`/v1/completions` with `echo`)."""

    conversation: Conversation | Rendered
    sampling: Sampling
    seed: int
    interventions: Interventions
    logprobs: int | None
    store: bool = True  # keep this row's KV in the prefix cache (off under --deterministic)
    future: asyncio.Future | None = None  # set by the server on its event loop
    loop: asyncio.AbstractEventLoop | None = None
    on_token: Callable[[int], None] | None = None  # called on the worker thread
    on_logprob: Callable[[TokenLogprob], None] | None = None  # each token's log-prob entry, before on_token
    # makes a watcher called with each token (stop strings; not a stream): a fresh one for each
    # decode run, since a failed batch is re-run one job at a time
    watch: Callable[[], Callable[[int], None]] | None = None
    queued_at: float = field(default_factory=time.monotonic)
    aborted: threading.Event = field(default_factory=threading.Event)  # read by the worker at every step
    stopped: threading.Event = field(default_factory=threading.Event)  # a stop string was sampled: end the row
    streamed: bool = False  # some of its tokens reached the client already
    resolved: bool = False  # its result was handed over (a short row finishes before its batch)
    score: bool = False  # score the prompt's tokens (result: TokenScores) instead of generating
    # read the conversation's last (assistant) reply again under three contexts (result: its divergences,
    # `protocol.divergence`); `end` is how that reply ended
    kl: bool = False
    end: str = "stop"

    def group(self) -> tuple[Any, ...]:
        """What jobs must share to start decoding in one call (token limits may differ: each row has its own)."""
        return (*self.lane(), tuple(self.interventions.specs()))

    def lane(self) -> tuple[Any, ...]:
        """What jobs must share to decode in one running batch (continuous batching): the sampling but
        for the token limit, log-probs and scoring, prompt tracing (one setting per batch), and the
        whole steer where it acts across the batch (CFG's twin rows, the pi floor); other steers
        are per-row data."""
        whole = self.interventions.kinds & BATCH_WIDE
        return (self.sampling.model_copy(update={"max_new_tokens": 1}), self.logprobs, self.score, self.kl,
                self.interventions.tracing(),
                tuple(self.interventions.specs()) if whole else None)

    def resolve(self, result: Reply | TokenScores | BaseException) -> None:
        """Hand the result to the waiting request (from the worker thread; the first result counts)."""
        self.resolved = True

        def _set() -> None:
            if self.future.done():  # aborted: the client left, timed out, or the server drained
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(_set)

    def abort(self, reason: BaseException) -> None:
        """Give up on this job (on the event loop): its row leaves the batch at the next step,
        and whoever awaits its future gets `reason`."""
        self.aborted.set()
        if not self.future.done():
            self.future.set_exception(reason)
            self.future.exception()  # retrieved: nobody may be left to await it (a client that left)


class Batcher:
    """The one thread that calls the backend; everything else talks to it through a queue."""

    def __init__(self, backend: ChatBackend, *, max_batch_size: int = 32, max_wait_s: float = 0.01,
                 max_queue: int = 256, continuous: bool = True) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.continuous = continuous
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._pending: deque[Job] = deque()  # taken off the queue by the worker, not yet decoding
        self.n_admitted = 0  # jobs that joined a running batch, ever
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="driftlab-batcher", daemon=True)
        self.batches: deque[int] = deque(maxlen=HISTORY)  # sizes of the last generate calls
        self.n_batches = 0  # generate calls made, ever
        self.on_batch: Callable[[int, list[Reply]], None] | None = None  # metrics: (size, replies)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closing.is_set():
            raise ServerClosing("the server is shutting down")
        if self.waiting >= self._queue.maxsize:  # the worker's own line counts too
            raise QueueFull(f"{self._queue.maxsize} requests are already waiting")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None

    @property
    def waiting(self) -> int:
        return self._queue.qsize() + len(self._pending)

    def sizes_since(self, n_batches: int) -> list[int]:
        """Sizes of the batches run after the first `n_batches` (those still remembered)."""
        return list(self.batches)[max(0, len(self.batches) - (self.n_batches - n_batches)):]

    def close(self, timeout: float = 60.0) -> None:
        """Finish the batch being decoded, refuse what is still queued, stop the thread."""
        self._closing.set()
        self._thread.join(timeout)
        self._take_queued()
        while self._pending:
            self._pending.popleft().resolve(ServerClosing("the server shut down before this request ran"))

    # -- worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._closing.is_set():
            if not self._pending and not self._gather():
                continue
            if self.continuous:
                self._take_queued()
                self._run(self._next_group())
                continue
            groups: dict[tuple[Any, ...], list[Job]] = {}
            while self._pending:
                job = self._pending.popleft()
                groups.setdefault(job.group(), []).append(job)
            for jobs in groups.values():
                self._run(jobs)

    def _gather(self) -> bool:
        """Wait for a first job, then gather more for at most `max_wait_s` (up to a batch)."""
        try:
            self._pending.append(self._queue.get(timeout=0.05))
        except queue.Empty:
            return False
        deadline = time.monotonic() + self.max_wait_s
        while len(self._pending) < self.max_batch_size:
            try:
                self._pending.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return True

    def _take_queued(self) -> None:
        """Move what waits in the queue to the worker's own line, without waiting."""
        while True:
            try:
                self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def _next_group(self) -> list[Job]:
        """The first job in line and the jobs behind it of its group, up to a batch."""
        group = self._pending[0].group()
        jobs = [j for j in self._pending if j.group() == group][: self.max_batch_size]
        for job in jobs:
            self._pending.remove(job)
        return jobs

    def _admit(self, live: list[Job], running: Callable[[], int]) -> list[Job]:
        """Jobs that join the running batch of `live` now: first in line, of its lane and of one
        steer (the next steer joins at the next step), while the batch has room. A job of another
        lane first in line stops admission, so the batch drains and that job runs next."""
        self._take_queued()
        lane, joining = live[0].lane(), []
        while self._pending and running() + len(joining) < self.max_batch_size:
            job = self._pending[0]
            if job.lane() != lane or (joining and job.group() != joining[0].group()):
                break
            self._pending.popleft()
            if not job.aborted.is_set():
                joining.append(job)
        self.n_admitted += len(joining)
        return joining

    def _run(self, jobs: list[Job]) -> None:
        live = [j for j in jobs if not j.aborted.is_set()]
        if not live:
            return
        try:
            replies = self._generate(live)
        except Exception as err:  # noqa: BLE001 - a failed batch must not fail the jobs that did nothing wrong
            if len(live) == 1:
                log.error("a request failed in the model", exc_info=err)
                live[0].resolve(err)
                return
            for job in live:  # one at a time: only the job that causes the error fails
                if job.resolved:
                    continue
                if job.streamed:  # its client already has tokens a re-run could contradict
                    job.resolve(err)
                else:
                    self._run([job])
            return
        for j, reply in zip(live, replies, strict=True):
            j.resolve(reply)

    def _generate(self, live: list[Job]) -> list[Reply] | list[TokenScores] | list[dict[str, float | int]]:
        if live[0].score or live[0].kl:
            self.batches.append(len(live))
            self.n_batches += 1
            if live[0].kl:  # (the generation's own cache entries stay as they were: keep_as_is=False)
                from driftlab.protocol.divergence import divergences

                return [d.fields() for d in divergences(self.backend, [(j.conversation, j.end) for j in live],
                                                        live[0].interventions, keep_as_is=False)]
            return score(self.backend, [j.conversation for j in live], live[0].interventions, top=live[0].logprobs or 0)
        watches: list[Callable[[int], None] | None] = []

        def start(jobs: list[Job]) -> None:  # jobs about to decode: a fresh stop watch each (a re-run starts over)
            for j in jobs:
                j.stopped.clear()
                watches.append(j.watch() if j.watch is not None else None)

        def on_token(row: int, token: int) -> None:
            if watches[row] is not None:
                watches[row](token)
            if live[row].on_token is not None:
                live[row].streamed = True
                live[row].on_token(token)

        def on_logprob(row: int, entry: TokenLogprob) -> None:
            if live[row].on_logprob is not None:
                live[row].on_logprob(entry)

        def admit() -> ChatRequest | None:  # `live` grows: its rows keep their numbers in every callback
            joining = self._admit(live, lambda: sum(not j.resolved for j in live))
            if not joining:
                return None
            start(joining)
            live.extend(joining)
            return self._request(joining)

        start(live)
        request = replace(self._request(live), on_token=on_token, on_logprob=on_logprob,
                          cancelled=lambda row: live[row].aborted.is_set() or live[row].stopped.is_set(),
                          on_finish=lambda row, reply: live[row].resolve(reply),  # a short reply need not wait
                          admit=admit if self.continuous else None)
        self.batches.append(len(live))
        self.n_batches += 1
        replies = self.backend.generate(request)
        if self.on_batch is not None:
            self.on_batch(len(live), replies)
        return replies

    @staticmethod
    def _request(jobs: list[Job]) -> ChatRequest:
        """The jobs' rows as one request, each with its own seed and token limit."""
        limits = [j.sampling.max_new_tokens for j in jobs]
        return ChatRequest([j.conversation for j in jobs],
                           jobs[0].sampling.model_copy(update={"max_new_tokens": max(limits)}),
                           seeds=[j.seed for j in jobs], row_max_tokens=limits, interventions=jobs[0].interventions,
                           logprobs=jobs[0].logprobs, cache_store=[j.store for j in jobs])
