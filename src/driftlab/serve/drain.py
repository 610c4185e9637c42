"""Graceful drain: what `driftlab serve` does between SIGTERM and exit.

On the first SIGTERM/SIGINT the server keeps listening but answers every new request 503
(in OpenAI's form, so load balancers and clients retry elsewhere), lets the requests and
streams in flight finish for up to `--graceful-timeout` seconds, then aborts what is left:
a waiting request gets 503, a stream gets an error event and `[DONE]`. Then it exits 0.
A second signal exits at once.
"""

from __future__ import annotations

import time
from typing import Any

from driftlab.serve.batcher import Job, ServerClosing


class Drain:
    """The requests in flight, and whether the server is draining (shared by app and server loop)."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.expired = False
        self._jobs: set[Job] = set()

    @property
    def draining(self) -> bool:
        return self.began is not None

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def begin(self) -> None:
        if self.began is None:
            self.began = time.monotonic()

    def enter(self, job: Job) -> None:
        self._jobs.add(job)

    def leave(self, job: Job) -> None:
        self._jobs.discard(job)

    def expire(self) -> None:
        """The graceful timeout is over: abort every request still in flight (on the event loop)."""
        self.expired = True
        for job in list(self._jobs):
            job.abort(ServerClosing("the server shut down before this request finished (--graceful-timeout)"))


def run_server(app: Any, host: str, port: int, graceful_timeout: float) -> None:
    """Serve `app` with uvicorn until SIGTERM/SIGINT, draining as described above."""
    import uvicorn

    drain: Drain = app.state.drain

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not uvicorn's: it would re-raise the signal after shutdown, so a clean drain
            # would end with status 143 instead of 0.
            if drain.draining:
                self.should_exit = self.force_exit = True
            else:
                drain.begin()

        async def on_tick(self, counter: int) -> bool:
            if drain.draining and not self.should_exit:
                waited = time.monotonic() - drain.began
                if drain.in_flight == 0:
                    self.should_exit = True
                elif not drain.expired and waited >= graceful_timeout:
                    drain.expire()
                elif drain.expired and waited >= graceful_timeout + 5:  # aborted streams had 5 s to close
                    self.should_exit = True
            return await super().on_tick(counter)

    # uvicorn's own graceful wait only covers connections still closing after the drain.
    DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()
