"""What every decoding method hands back: the token sink (stop rules, streaming, cancellation), the typed result
and statistics, the phase timer, and the length check.

The sink takes tokens one at a time, so a method that emits several tokens per round (SWIFT) stops at exactly the
token plain autoregressive decoding would have stopped at.
"""
from __future__ import annotations

import atexit
import math
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import SwiftkError

@dataclass
class DecodeStats:
    """Per-call statistics (JSON-serialisable with ``to_dict``; ``stats["name"]`` reads a field too)."""

    method: str = ""
    arithmetic: str = ""               # the numerical model that ran, e.g. "Q4_1 blocks x int8 activations"
    new_tokens: int = 0
    prompt_tokens: int = 0
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    decoding_steps: int = 0            # target forward passes (prefill, plain steps, verify passes)
    rounds: int = 0                    # speculative rounds (verify passes of a tree with drafted nodes)
    plain_steps: int = 0               # rounds the speed gate decided to decode one token plainly
    mean_accepted_length: float = 0.0  # M: tokens emitted per verify pass (accepted + bonus)
    acceptance_rate: float = 0.0       # alpha = accepted drafted tokens / drafted tokens
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_source: dict = field(default_factory=dict)  # source name -> accepted tokens
    max_tree_nodes: int = 0
    time_prefill_s: float = 0.0        # the prompt's pass, up to the first new token (no draft can speed it up)
    prompt_reused: int = 0             # prompt tokens whose KV the engine's previous call left (not prefilled)
    shared_passes: int = 0             # target passes that also carried other calls' rows (a batch)
    queue_time_s: float = 0.0          # from the request's making to its call's start (waiting for a batch slot)
    time_optimize_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_other_s: float = 0.0
    skip_set: Optional[dict] = None
    exit_layer: Optional[int] = None
    best_matchness: Optional[float] = None
    optimization_done: Optional[bool] = None
    optimization_steps: Optional[int] = None
    longest_bo_stall_ms: float = 0.0
    bo_errors: list = field(default_factory=list)
    costs: Optional[dict] = None       # the cost model the gate used (seconds)
    # per-round lists, kept with the decode option trace=True
    accept_lengths: list = field(default_factory=list)    # tokens emitted per verify pass
    tree_sizes: list = field(default_factory=list)
    phases: list = field(default_factory=list)            # per round: context / optimize / accelerate / plain
    matchness_history: list = field(default_factory=list)  # (generated tokens so far, matchness, source)
    expected_vs_measured: list = field(default_factory=list)  # per round: (expected tok/s, measured tok/s)

    def __getitem__(self, key):
        return getattr(self, key)

    def __contains__(self, key) -> bool:
        return hasattr(self, key)

    def get(self, key, default=None):
        return getattr(self, key, default)

    def to_dict(self) -> dict:
        return asdict(self)

    def finish(self) -> "DecodeStats":
        n = self.rounds
        self.mean_accepted_length = (self.accepted_tokens + n) / n if n else 0.0
        self.acceptance_rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        return self


@dataclass
class GenerationResult:
    text: str
    token_ids: list
    prompt_ids: list
    finish_reason: str            # "eos" | "stop" | "length" | "cancelled"
    stats: DecodeStats = field(default_factory=DecodeStats)
    # generate(logprobs=K): per token of token_ids, {"token_id", "logprob", "top": [[id, logprob] * K]}; else None
    logprobs: Optional[list] = None


MAX_LOGPROBS = 20   # alternatives per token at most (OpenAI's limit)


class TokenLogprobs:
    """The log-probabilities of a call's emitted tokens under the target: log-softmax of the very scores that chose
    each token (the verify pass's rows, batch invariant), before temperature, top-k and top-p, as vLLM reports
    them; so they are the same with or without speculation. ``top``: the K most likely alternatives too."""

    def __init__(self, top: int):
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise SwiftkError(f"logprobs must be an int in 0..{MAX_LOGPROBS} (alternatives per token), got {top!r}")
        self.top, self.entries = top, []

    def of(self, rows, tokens: list) -> list:
        # in numpy: torch's ops on vocabulary-long rows run OpenMP regions whose spinning threads slowed the next
        # target pass (~20% on 2 cores)
        x = rows.detach().cpu().float().numpy().astype(np.float64)
        top = x.max(-1, keepdims=True)
        lp = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
        out = [{"token_id": int(t), "logprob": float(lp[j, int(t)]), "top": []} for j, t in enumerate(tokens)]
        if self.top:
            for j, e in enumerate(out):   # the K likeliest, larger first, equal ones by lower id
                ids = np.argpartition(-lp[j], self.top - 1)[: self.top]
                ids = sorted(ids.tolist(), key=lambda i: (-lp[j, i], i))
                e["top"] = [[i, float(lp[j, i])] for i in ids]
        return out


class TokenSink:
    """Collects new tokens, applies eos / stop strings / max_new_tokens, streams decoded text.

    ``cancel`` (a threading.Event) ends generation at the next token: an abandoned stream() sets it."""

    def __init__(self, tokenizer, max_new_tokens: int, stop: Sequence[str] = (), callback: Optional[Callable] = None,
                 cancel: Optional[threading.Event] = None):
        self.tok = tokenizer
        self.max_new = max_new_tokens
        self.stop = [s for s in stop if s]
        self.callback = callback
        self.cancel = cancel
        self.ids: list = []
        self.finish_reason: Optional[str] = None
        self._emitted = ""   # text already streamed
        self._text = ""      # the text so far, while a stop string or a stream needs it token by token
        self._full = ("", 0)   # (decode of the first n ids, n): the text as read, decoded once
        # decoding every prefix after each token made a call O(n^2) in its length (0.13 ms a token at 2k tokens):
        # the text is decoded when read, and token by token only incrementally where the tokenizer can
        self._step = tokenizer.decode_stream() if (self.stop or callback) and hasattr(tokenizer, "decode_stream") \
            else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Add one token; returns True when generation must stop."""
        if self.done:
            return True
        self.ids.append(token)
        if token in self.tok.eos_ids:
            self.finish_reason = "eos"
        if self.stop or self.callback is not None:
            self._text, same = self._next_text(token)
            if self.stop:   # only where a stop string could end in the new text
                start = max(0, same - max(len(s) for s in self.stop) + 1)
                cut = min((i for i in (self._text.find(s, start) for s in self.stop) if i >= 0), default=-1)
                if cut >= 0:
                    self._text = self._text[:cut]
                    self.finish_reason = "stop"
        if not self.done and len(self.ids) >= self.max_new:
            self.finish_reason = "length"
        if not self.done and self.cancel is not None and self.cancel.is_set():
            self.finish_reason = "cancelled"
        if self.done and self.finish_reason != "stop" and self._step is not None:
            self._text = self.text   # the last piece may be held back (an incomplete character): flush all
        self._stream()
        return self.done

    def _next_text(self, token: int) -> tuple:
        """(the text with ``token``, how many leading characters are unchanged)."""
        old = self._text
        if self._step is not None:
            try:
                return old + self._step(token), len(old)
            except Exception:  # noqa: BLE001 - the backend's stream refuses some byte sequences: decode in full
                self._step = None
        new = self.tok.decode(self.ids)   # a full decode may rewrite the tail (an incomplete character completed)
        return new, len(os.path.commonprefix([old, new]))

    def extend(self, tokens) -> bool:
        for t in tokens:
            if self.push(int(t)):
                return True
        return False

    def _stream(self) -> None:
        if self.callback is None:
            return
        text = self._text
        if not self.done:
            # hold back a possibly incomplete UTF-8 sequence and anything that might start a stop string
            text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: max(len(self._emitted), len(text) - hold)]
        if len(text) > len(self._emitted) and text.startswith(self._emitted):
            self.callback(text[len(self._emitted):])
            self._emitted = text

    @property
    def text(self) -> str:
        if self.finish_reason == "stop":   # cut at the stop string
            return self._text
        if self._full[1] != len(self.ids):
            self._full = (self.tok.decode(self.ids), len(self.ids))
        return self._full[0]


class Timer:
    """Accumulates wall time per named phase (host clock; callers on GPU synchronise where they need exactness)."""

    def __init__(self):
        self.totals: dict = {}

    def add(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - t0
        return now


def check_lengths(prompt_len: int, max_new_tokens, limit: int, model_ctx: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise SwiftkError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > limit:
        raise SwiftkError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds the context ({limit} tokens; model context {model_ctx}, set max_context= on load to change)"
        )


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else math.inf


def progress_bar(total: int, callback, count):
    """(a tqdm bar, a callback that moves it to ``count()`` tokens, then calls ``callback``): progress=True."""
    from tqdm import tqdm   # lazy: only for progress=True

    bar = tqdm(total=total, unit="tok", leave=False)

    def cb(piece):
        bar.n = count()
        bar.refresh()
        if callback:
            callback(piece)

    return bar, cb


# Streams whose worker thread is still decoding: at interpreter exit they are cancelled and joined (_end_streams). A
# daemon worker left inside a kernel when the interpreter finalizes is torn down mid-call (abort: "terminate called
# without an active exception").
_LIVE: dict = {}   # worker thread -> its cancel event
_EXIT_WAIT_S = 60.0


def _end_streams() -> None:
    for th, cancel in list(_LIVE.items()):
        cancel.set()
    for th in list(_LIVE):
        th.join(_EXIT_WAIT_S)   # a cancelled call ends at its next token (or prefill chunk)


atexit.register(_end_streams)


def stream_pieces(generate, prompt, **kw):
    """``generate(prompt, callback=..., _cancel=..., **kw)`` in a worker thread, its text pieces yielded as they
    come; closing the iterator cancels the generation at its next token."""
    q: queue.Queue = queue.Queue()
    done, box, cancel = object(), {}, threading.Event()

    def run():
        try:
            box["result"] = generate(prompt, callback=q.put, _cancel=cancel, **kw)
        except BaseException as e:  # surfaced in the consumer
            box["error"] = e
        finally:
            _LIVE.pop(threading.current_thread(), None)
            q.put(done)

    th = threading.Thread(target=run, daemon=True, name="swiftk-stream")
    _LIVE[th] = cancel
    th.start()
    try:
        while (item := q.get()) is not done:
            yield item
    finally:
        cancel.set()
        th.join()
    if "error" in box:
        raise box["error"]
