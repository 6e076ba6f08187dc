"""swiftk's background threads (the corpus build, the skip-set search's GP fit), and their end before the
interpreter's.

They are daemon threads, so a script never waits for them to exit; but a daemon thread still inside native code
(scipy, sklearn, the tokenizer) when Python finalizes is unwound by force when it returns, and a C++ frame on its
stack then aborts the process ("terminate called without an active exception"). So at exit (atexit runs before
finalization) every live one is asked to stop -- long jobs call :func:`check` between pieces of work -- and joined;
a wait past a quarter second says so on stderr, and Ctrl-C during it ends the process at once with one line and
status 130 (skipping finalization, so the abort cannot happen either).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable

JOIN_S = 30.0   # at exit, for all of them: the longest piece of work between two checks is ~1 s

_stop = threading.Event()
_live: set = set()
_live_lock = threading.Lock()


class Stopped(Exception):
    """Raised by :func:`check` in a background job once the interpreter is exiting."""


def check() -> None:
    """Call between pieces of a long job: raises :class:`Stopped` once the interpreter is exiting."""
    if _stop.is_set():
        raise Stopped("the interpreter is exiting")


class Background(threading.Thread):
    """``make()`` on a daemon thread, its return value in ``result`` (``None`` when it raised: then ``error``
    holds the exception). ``low_priority``: the lowest CPU priority (Linux: per thread), so decoding goes first."""

    def __init__(self, make: Callable, name: str, low_priority: bool = False):
        super().__init__(daemon=True, name=name)
        # started once the exit handler has run (by a thread still decoding): a thread that only stops, which
        # no join waits for and which runs no native code
        self._make = make if not _stop.is_set() else _stopped
        self._low = low_priority
        self.result, self.error = None, None
        with _live_lock:
            _live.add(self)
        try:
            self.start()
        except BaseException:
            with _live_lock:
                _live.discard(self)
            raise

    def run(self) -> None:
        try:
            if self._low:
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
                except (AttributeError, OSError):
                    pass
            self.result = self._make()
        except BaseException as e:  # noqa: BLE001 - handed to the owner, which decides
            self.error = e
        finally:
            with _live_lock:
                _live.discard(self)


def _stopped():
    raise Stopped("the interpreter is exiting")


SAY_AFTER_S = 0.25   # a wait at exit longer than this is announced


@atexit.register
def _finish() -> None:
    _stop.set()
    _join_live()


def stop_jobs() -> None:
    """Stop and join the jobs running now, announced as at exit, then let new ones start again: the CLI calls it
    on an error exit, so that its error is the last line printed (and an embedding caller of cli.main goes on)."""
    _stop.set()
    try:
        _join_live()
    finally:
        _stop.clear()


def _join_live() -> None:
    with _live_lock:
        threads = list(_live)
    if not threads:
        return
    try:
        deadline, said = time.monotonic() + JOIN_S, False
        for t in threads:
            t.join(min(SAY_AFTER_S, max(0.0, deadline - time.monotonic())))
            if t.is_alive() and not said:
                said = True
                names = ", ".join(sorted({x.name for x in threads if x.is_alive()}))
                print(f"swiftk: stopping background work before exit ({names}); Ctrl-C skips it", file=sys.stderr,
                      flush=True)
            t.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        try:
            print("swiftk: interrupted", file=sys.stderr, flush=True)
            sys.stdout.flush()
        finally:
            os._exit(130)


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads (and perhaps a lock taken by one of them)."""
    global _live_lock
    _live_lock = threading.Lock()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["Background", "Stopped", "check", "stop_jobs"]
