"""swiftk's background threads (the corpus build, the skip-set search's GP fit), and their end before the
interpreter's.

They are daemon threads, so a script never waits for them to exit; but a daemon thread still inside native code
(scipy, sklearn, the tokenizer) when Python finalizes is unwound by force when it returns, and a C++ frame on its
stack then aborts the process ("terminate called without an active exception"). So at exit (atexit runs before
finalization) every live one is asked to stop -- long jobs call :func:`check` between pieces of work -- and joined.
"""
from __future__ import annotations

import atexit
import os
import threading
from typing import Callable

JOIN_S = 30.0   # at exit, per thread: the longest piece of work between two checks is ~1 s

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
        self._make, self._low = make, low_priority
        self.result, self.error = None, None
        with _live_lock:
            _live.add(self)
        self.start()

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


@atexit.register
def _finish() -> None:
    _stop.set()
    with _live_lock:
        threads = list(_live)
    for t in threads:
        t.join(JOIN_S)


__all__ = ["Background", "Stopped", "check"]
