"""What crosses from the engine into decoding for one call: the checked :class:`Request`, the batch :class:`Slot`
it decodes on (a KV cache of its own and what it still holds), and the open :class:`Call`."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .decoding.output import TokenSink
from .decoding.prefix import HeldPrefix
from .decoding.sampler import Sampler, SamplingParams
from .errors import SwiftkError
from .options import DecodeConfig

MAX_BATCH = 64   # calls decoding together at most (each holds a KV cache of the engine's context)


@dataclass
class Request:
    """``Engine.generate``'s arguments, checked (Engine.request): everything a call needs to start decoding."""

    ids: list                     # the prompt's token ids
    max_new_tokens: int
    method: object                # a methods.Method
    sampling: SamplingParams
    stop: list
    cfg: DecodeConfig             # the call's decode options
    fixed: object                 # the draft's skip set when the call fixes it, else None
    state: object                 # the learned state asked for (None: the engine's for the method)
    proposers: list
    reuse_ok: bool                # the prompt may reuse the KV its slot holds (prefix_cache, where exact)
    exit_layer: Optional[int]
    callback: Optional[Callable] = None
    progress: bool = False
    cancel: Optional[threading.Event] = None


@dataclass
class Slot:
    """One KV cache of the engine's batch and the tokens whose KV it still holds from its last call."""

    cache: object                 # runtime.kvcache.KVCache
    held: HeldPrefix = field(default_factory=HeldPrefix)


@dataclass
class Call:
    """A request being decoded: its slot, learned state, sink and sampler, and its Decoder (None: the reference
    method's own loop, alone)."""

    req: Request
    slot: Slot
    state: object
    sink: TokenSink
    sampler: Sampler
    reuse: int                    # prompt slots whose KV the slot already held
    bar: object = None            # the progress bar (progress=True)
    t0: float = field(default_factory=time.perf_counter)
    decoder: object = None        # decoding.loop.Decoder

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def check_max_batch(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BATCH:
        raise SwiftkError(f"max_batch must be an int in 1..{MAX_BATCH}, got {n!r}")
    return n


def default_max_batch(slot_bytes: int) -> int:
    """Calls to decode together by default, sized to the machine: 4 per core up to 8 (a pass of 8 rows costs 1.5-5
    plain steps on the CPUs measured, so more calls stop paying), and never KV caches over a quarter of the
    memory."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 8 << 30
    by_memory = max(1, mem // 4 // max(1, slot_bytes))
    return int(max(1, min(8, 4 * (os.cpu_count() or 1), by_memory)))
