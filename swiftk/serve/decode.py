"""The server's decode thread: requests decode together (swiftk.scheduler.Scheduler: continuous batching, every
round of every running request in one target pass), with a bounded wait queue, cancellation and shutdown."""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from ..requests import Request
from ..scheduler import Scheduler
from .api import APIError, Cancelled

log = logging.getLogger("swiftk.serve")


class DecodeThread:
    """The engine's one decode thread: a swiftk.scheduler.Scheduler stepped while it has requests, holding the
    engine for each round; at most ``queue_size`` requests waiting for a slot."""

    def __init__(self, engine, max_batch: int, queue_size: int):
        self.engine, self.max_batch, self.queue_size = engine, max_batch, queue_size
        engine.slots.reserve(max_batch, f"--max-batch {max_batch}")   # refused here, not by the allocator
        for i in range(max_batch):   # every slot's KV cache now: a server's memory is set at start, never mid-request
            engine.slots.get(i)
        self.sched = Scheduler(engine.calls, max_batch)
        self._lock = threading.Lock()
        self._live: set = set()   # cancel events of the waiting and running jobs
        self._job_s = 1.0         # moving mean of a job's duration, for Retry-After
        self.closing = False
        self.served = self.cancelled = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="swiftk-decode")
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self.sched.waiting

    @property
    def running(self) -> int:
        return self.sched.running

    def submit(self, req: Request) -> Future:
        """Queue an engine Request (Calls.request); the future gets its GenerationResult or its error."""
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list) -> list:
        """Queue Requests together, all or none (one request's choices): their futures, in order."""
        with self._lock:
            if self.closing:
                raise APIError(503, "the server is shutting down")
            waiting, running = self.sched.load()   # free slots take waiting requests first, the queue the rest
            if waiting + len(reqs) > self.queue_size + max(0, self.max_batch - running):
                retry = max(1, math.ceil(self._job_s * (waiting + len(reqs)) / self.max_batch))
                what = f"{len(reqs)} more requests" if len(reqs) > 1 else "another request"
                raise APIError(429, f"no room for {what}: all {self.max_batch} decoding slots are busy or taken "
                               f"and {waiting} requests are waiting (queue size {self.queue_size}); retry in "
                               f"{retry} s", code="queue_full", headers={"Retry-After": str(retry)})
            for req in reqs:
                self._live.add(req.cancel)
        futs = []
        for req in reqs:
            fut: Future = Future()
            self.sched.submit(req, self._done(req, fut))
            futs.append(fut)
        return futs

    def _done(self, req: Request, fut: Future):
        def done(result, error):
            with self._lock:
                self._live.discard(req.cancel)
                self.served += 1
                self.cancelled += req.cancel.is_set()
                self._job_s = 0.8 * self._job_s + 0.2 * (time.perf_counter() - req.arrival)
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        return done

    def _run(self) -> None:
        while not self.closing:
            if not self.sched.wait_for_work(0.5):
                continue
            try:
                with self.engine.calls.hold():   # the engine's KV caches are the batch's for the round
                    self.sched.step()
            except Exception:  # noqa: BLE001 - the scheduler fails requests, not itself; log anything else
                log.exception("swiftk serve: decode round failed")
        self.sched.cancel_all(Cancelled())

    def close(self) -> None:
        """Refuse new jobs; the waiting ones end unrun and the running ones at their next token."""
        with self._lock:
            self.closing = True
            for ev in self._live:
                ev.set()
        self.sched.wake()
