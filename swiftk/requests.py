"""What crosses from the engine into decoding for one call: the checked :class:`Request`, the batch :class:`Slot`
it decodes on (a KV cache of its own and what it still holds), and the open :class:`Call`."""
from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .decoding.grammar import GrammarState
from .decoding.loop import Decoder
from .decoding.output import TokenLogprobs, TokenSink
from .decoding.prefix import HeldPrefix
from .sample.sampler import Sampler, SamplingParams
from .decoding.state import LearnedState
from .errors import SwiftkError
from .methods import Method
from .options import DecodeConfig
from .runtime.kvcache import KVCache

MAX_BATCH = 64   # calls decoding together at most (each holds a KV cache of the engine's context)


@dataclass(kw_only=True)
class Request:
    """``Engine.generate``'s arguments, checked once (calls.Calls.request): everything a call needs to start decoding,
    whoever asked for it (``generate``, ``generate_many``, the server)."""

    ids: list                     # the prompt's token ids
    max_new_tokens: int
    method: Method
    sampling: SamplingParams
    stop: list
    cfg: DecodeConfig             # the call's decode options
    fixed: Optional[torch.Tensor]   # the draft's skip set when the call fixes it, else None
    state: Optional[LearnedState]   # the learned state asked for (None: the engine's for the method)
    proposers: list
    reuse_ok: bool                # the prompt may reuse the KV its slot holds (prefix_cache, where exact)
    exit_layer: Optional[int]
    callback: Optional[Callable] = None
    progress: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)   # set: decoding stops at its next token
    arrival: float = field(default_factory=time.perf_counter)   # when it was made: its queue time counts from here
    logprobs: Optional[TokenLogprobs] = None   # logprobs=K asked: the emitted tokens' log-probabilities, filled in
    grammar: Optional[GrammarState] = None     # grammar= asked: the call's constraint, advanced as it decodes


@dataclass
class Slot:
    """One KV cache of the engine's batch and the tokens whose KV it still holds from its last call."""

    cache: KVCache
    held: HeldPrefix = field(default_factory=HeldPrefix)


@dataclass
class Call:
    """A request being decoded: its slot, learned state, sink and sampler, and its Decoder (the reference method's
    has no drafter)."""

    req: Request
    slot: Slot
    state: LearnedState
    sink: TokenSink
    sampler: Sampler
    reuse: int                    # prompt slots whose KV the slot already held
    bar: object = None            # the progress bar (progress=True)
    t0: float = field(default_factory=time.perf_counter)
    decoder: Optional[Decoder] = None   # set by Calls.open_call, once the Session is made

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def check_max_batch(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BATCH:
        raise SwiftkError(f"max_batch must be an int in 1..{MAX_BATCH}, got {n!r}")
    return n


def available_memory() -> int:
    """Bytes this process can still allocate: the least of the machine's available memory, its cgroup's headroom
    and its address-space limit (``ulimit -v``) less what it maps now."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for cap, use in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                     ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(cap) as f, open(use) as g:
                c = f.read().strip()
                if c != "max" and int(c) < 1 << 60:
                    limits.append(int(c) - int(g.read().strip()))
            break
        except (OSError, ValueError):
            continue
    try:
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            limits.append(soft - vm)
    except (OSError, ValueError, StopIteration):
        pass
    if not limits:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 8 << 30
    return max(0, min(limits))


def check_slots_fit(new_slots: int, slot_bytes: int, asked: str) -> None:
    """Refuse ``new_slots`` more KV caches of ``slot_bytes`` each when they would not fit in memory (with a tenth
    to spare for the passes' activations), naming how many do."""
    need, avail = new_slots * slot_bytes, available_memory()
    if new_slots > 0 and need > 0.9 * avail:
        fit = int(0.9 * avail // max(1, slot_bytes))
        raise SwiftkError(f"{asked} needs {new_slots} more KV cache(s) of {slot_bytes / 2**20:.0f} MiB "
                          f"({need / 2**30:.2f} GiB), but only {avail / 2**30:.2f} GiB of memory is available: "
                          f"{fit} more fit (ask for fewer calls at once, or load with a smaller max_context)")


class SlotPool:
    """The batch slots of an engine: a KV cache each, slot 0's made at load, the others at first use and only
    where memory allows. The engine owns the pool (a slot keeps what its cache holds across calls: prefix reuse);
    every scheduler decodes on it."""

    def __init__(self, model, first: KVCache, slots_per_cache: int):
        self.model, self.slots_per_cache = model, slots_per_cache
        self._slots = [Slot(first)]

    def __len__(self) -> int:
        """Slots whose KV cache exists."""
        return len(self._slots)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's KV cache."""
        d = self._slots[0].cache.data
        return d.numel() * d.element_size()

    def default_max_batch(self) -> int:
        """Calls decoded together when not told (:func:`default_max_batch`: by cores and available memory)."""
        return default_max_batch(self.slot_bytes)

    def reserve(self, n: int, asked: str) -> None:
        """Refuse, before any work, ``n`` slots whose KV caches would not fit in memory (``asked``: what asked for
        them, for the message)."""
        check_slots_fit(max(0, n - len(self._slots)), self.slot_bytes, asked)

    def made(self, i: int) -> Optional[Slot]:
        """Slot ``i`` if its KV cache exists, else None (looking allocates nothing)."""
        return self._slots[i] if i < len(self._slots) else None

    def get(self, i: int) -> Slot:
        """Slot ``i``, its KV cache made now if it has none yet."""
        while len(self._slots) <= i:
            check_slots_fit(1, self.slot_bytes, f"batch slot {len(self._slots)}")
            try:
                cache = self.model.new_cache(self.slots_per_cache)
            except (RuntimeError, MemoryError) as e:   # the allocator's own refusal, worded for a user
                raise SwiftkError(f"cannot allocate the KV cache of batch slot {len(self._slots)} "
                                  f"({self.slot_bytes / 2**20:.0f} MiB): out of memory ({e})") from None
            self._slots.append(Slot(cache))
        return self._slots[i]


def default_max_batch(slot_bytes: int) -> int:
    """Calls to decode together by default, sized to the machine: 4 per core up to 8 (a pass of 8 rows costs 1.5-5
    plain steps on the CPUs measured, so more calls stop paying), and never KV caches over a quarter of the
    memory available."""
    by_memory = max(1, available_memory() // 4 // max(1, slot_bytes))
    return int(max(1, min(8, 4 * (os.cpu_count() or 1), by_memory)))
