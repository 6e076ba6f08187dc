"""The scheduler owns the requests of a batch: a request takes a free batch slot (a KV cache of the engine's) when
one is free, else it waits in arrival order; every round of the running calls is one decoding.batch.Batch step (one
target pass for all of them); a call that finishes, fails or is cancelled leaves between rounds and its slot goes to
the next waiting request. Engine.generate_many runs one to completion; the server steps one from its decode thread.

A prompt whose start a running call is prefilling (n choices of one prompt, a shared system prompt) waits until that
start is prefilled and then copies its KV instead of computing it again: the same rows bit for bit where prefix
reuse is exact (``Request.reuse_ok``), so the output does not change.

The scheduler drives the engine's calls (calls.Calls) through :class:`CallHost` (the engine imports this module,
not the other way round).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional, Protocol

from .decoding.batch import Batch
from .decoding.output import DecodeStats, GenerationResult
from .requests import Call, Request, SlotPool
from .runtime.model import Model

SHARE_MIN = 32   # prompt tokens in common with a running call's worth waiting for its prefill and copying its KV
# done(result, error): exactly one of them is None
Done = Callable[[Optional[GenerationResult], Optional[BaseException]], None]


class CallHost(Protocol):
    """What the scheduler needs of the engine (calls.Calls): its batch slots (a KV cache each) and calls opened and
    closed on them."""
    model: Model
    slots: SlotPool

    def open_call(self, req: Request, slot: int) -> Call: ...

    def close_call(self, call: Call, stats: DecodeStats) -> GenerationResult: ...


class Scheduler:
    def __init__(self, host: CallHost, max_batch: int, whole_prompts: bool = False):
        """``whole_prompts``: prefill each prompt in one pass (a caller that submits everything at once, with one
        slot: nothing can arrive to join); else in chunks, so that the server's next request joins sooner."""
        self.host, self.max_batch = host, max_batch
        self.batch = Batch(host.model, whole_prompts=whole_prompts)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._waiting: deque = deque()     # (request, done), arrival order
        self._running: dict = {}           # decoder -> (call, done, slot index)
        self._free = list(range(max_batch))
        self._opening = 0                  # taken off the queue, not yet running (counted as running)

    # ------------------------------------------------------------------ from any thread
    def submit(self, req: Request, done: Done) -> None:
        with self._work:
            self._waiting.append((req, done))
            self._work.notify()

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests holding a slot: running, or being opened (between the queue and the batch)."""
        with self._lock:
            return len(self._running) + self._opening

    def load(self) -> tuple:
        """(waiting, holding a slot), read together: a request moving between them is counted once."""
        with self._lock:
            return len(self._waiting), len(self._running) + self._opening

    def wait_for_work(self, timeout: float) -> bool:
        """Block until a request waits or runs (True), or ``timeout`` seconds pass."""
        with self._work:
            if not self._waiting and not self._running:
                self._work.wait(timeout)
            return bool(self._waiting or self._running)

    def wake(self) -> None:
        with self._work:
            self._work.notify_all()

    # ------------------------------------------------------------------ from the thread that holds the engine
    def step(self) -> None:
        """Admit what fits, then one round of every running call; retire those that ended."""
        self._drop_cancelled_waiting()
        self._admit()
        if not self._running:
            return
        failed: dict = {}
        self.batch.step(lambda d, e: failed.setdefault(d, e))
        for d in list(self._running):
            if d in failed:
                self._retire(d, error=failed[d])
            elif d.done or (d.s.prefilling and self._cancelled(self._running[d][0].req)):
                self._retire(d)

    def run_until_idle(self) -> None:
        while self._waiting or self._running:
            self.step()

    def cancel_all(self, error: BaseException) -> None:
        """End every waiting and running request with ``error`` (shutdown)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for _, done in waiting:
            done(None, error)
        for d in list(self._running):
            self._retire(d, error=error)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _cancelled(req: Request) -> bool:
        return req.cancel.is_set()

    def _drop_cancelled_waiting(self) -> None:
        with self._lock:
            gone = [(r, d) for r, d in self._waiting if self._cancelled(r)]
            self._waiting = deque((r, d) for r, d in self._waiting if not self._cancelled(r))
        for r, done in gone:
            done(_cancelled_result(r), None)

    def _admit(self) -> None:
        while self._free:
            with self._lock:
                ready = self._next_ready()
                if ready is None:
                    return
                k, twin, shared = ready
                req, done = self._waiting[k]
                del self._waiting[k]
                self._opening += 1   # never counted neither waiting nor running (admission reads both)
            try:
                slot = self._pick_slot(req)
                if twin is not None:
                    self._copy_start(twin, shared, req, slot)
                call = self.host.open_call(req, slot)
            except Exception as e:  # noqa: BLE001 - a request that cannot start fails alone
                with self._lock:
                    self._opening -= 1
                done(None, e)
                continue
            self._free.remove(slot)
            self.batch.add(call.decoder)
            with self._lock:
                self._running[call.decoder] = (call, done, slot)
                self._opening -= 1

    def _next_ready(self) -> Optional[tuple]:
        """(index, twin, shared) of the first waiting request that may open now (its twin from ``_twin``), else None.
        One waiting for a running call's prefill of its prompt's start is passed over; a later one may open first."""
        for k, (req, _) in enumerate(self._waiting):
            # a method whose drafter keeps one engine-wide state (a draft model's cache, MoA's) decodes one call
            # at a time; later requests wait behind it, in order
            if getattr(req.method, "one_at_a_time", False) and any(
                    getattr(c.req.method, "one_at_a_time", False) for c, _, _ in self._running.values()):
                return None
            twin, shared = self._twin(req)
            filled = None if twin is None else twin.decoder.s.filled
            if twin is None or (filled is not None and filled >= shared):   # no wait past the shared start
                return k, twin, shared
        return None

    def _twin(self, req: Request) -> tuple:
        """(the running call whose prompt shares the longest start with ``req``'s, that length), when it is at
        least SHARE_MIN tokens and reuse is exact for both; else (None, 0)."""
        if not req.reuse_ok:
            return None, 0
        best, most = None, SHARE_MIN - 1
        for call, _, _ in self._running.values():
            if not call.req.reuse_ok:
                continue
            # the last prompt token is always passed: its row gives the first token
            n = _common_start(call.req.ids, req.ids, min(len(call.req.ids), len(req.ids) - 1))
            if n > most:
                best, most = call, n
        return (best, most) if best is not None else (None, 0)

    def _copy_start(self, twin, shared: int, req: Request, slot: int) -> None:
        """Give ``slot`` the twin call's KV of the shared prompt start, unless the slot already holds as much."""
        sl = self.host.slots.get(slot)
        shared = min(shared, twin.slot.cache.length)
        if sl.held.shared(sl.cache, req.ids) < shared:
            sl.cache.copy_prefix(twin.slot.cache, shared)
            sl.held.record(sl.cache, req.ids[:shared])

    def _pick_slot(self, req: Request) -> int:
        """The free slot whose cache still holds the longest start of this prompt (prefix reuse), else the lowest
        whose cache exists, else the lowest: a KV cache is made only when no free one exists."""
        made = [i for i in sorted(self._free) if self.host.slots.made(i) is not None]
        best = made[0] if made else min(self._free)
        if not req.reuse_ok:
            return best
        most = 0
        for i in made:
            sl = self.host.slots.made(i)
            n = sl.held.shared(sl.cache, req.ids)
            if n > most:
                best, most = i, n
        return best

    def _retire(self, d, error: Optional[BaseException] = None) -> None:
        with self._lock:
            call, done, slot = self._running.pop(d)
        self.batch.remove(d)
        self._free.append(slot)
        call.end()
        if error is not None:
            call.slot.held.forget()
            done(None, error)
            return
        if d.s.prefilling:   # cancelled before its first token
            call.slot.held.forget()
            done(_cancelled_result(call.req), None)
            return
        try:
            result = self.host.close_call(call, d.close())
        except Exception as e:  # noqa: BLE001
            done(None, e)
            return
        done(result, None)


def _common_start(a: list, b: list, top: int) -> int:
    """Length of the common start of ``a`` and ``b``, at most ``top``: a binary search over slice comparisons
    (each in C), as this runs for every waiting request at every round."""
    if top < SHARE_MIN or a[:SHARE_MIN] != b[:SHARE_MIN]:
        return 0
    lo, hi = SHARE_MIN, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _cancelled_result(req: Request) -> GenerationResult:
    return GenerationResult(text="", token_ids=[], prompt_ids=req.ids, finish_reason="cancelled", stats=DecodeStats())
