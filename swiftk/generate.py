"""What every decoding method shares: validated settings, the token sink (stop rules, streaming) and the result.

The sink takes tokens one at a time, so a method that emits several tokens per step (SWIFT) stops at exactly the
token plain autoregressive decoding would have stopped at.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .errors import SwiftkError
from .sampling import process_logits, sample, validate_sampling_params

METHODS = ("swift", "autoregressive", "early_exit", "static")


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def validate(self) -> "SamplingParams":
        validate_sampling_params(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SwiftkError(f"seed must be an int or None, got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: torch.Tensor, gen: torch.Generator) -> int:
        """Next token from one row of logits: argmax when greedy, else a draw from the processed distribution."""
        if self.greedy:
            return int(torch.argmax(logits))
        return int(sample(self.probs(logits), gen))


@dataclass
class GenerationResult:
    text: str
    token_ids: list
    prompt_ids: list
    finish_reason: str            # "eos" | "stop" | "length"
    stats: dict = field(default_factory=dict)


class TokenSink:
    """Collects new tokens, applies eos / stop strings / max_new_tokens, streams decoded text."""

    def __init__(self, tokenizer, max_new_tokens: int, stop: Sequence[str] = (), callback: Optional[Callable] = None):
        self.tok = tokenizer
        self.max_new = max_new_tokens
        self.stop = [s for s in stop if s]
        self.callback = callback
        self.ids: list = []
        self.finish_reason: Optional[str] = None
        self._emitted = ""   # text already streamed
        self._text = ""

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
        self._text = self.tok.decode(self.ids)
        if self.stop:
            cut = min((i for i in (self._text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self._text = self._text[:cut]
                self.finish_reason = "stop"
        if not self.done and len(self.ids) >= self.max_new:
            self.finish_reason = "length"
        self._stream()
        return self.done

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
        return self._text


class Timer:
    """Accumulates wall time per named phase (host clock; callers on GPU synchronise where they need exactness)."""

    def __init__(self):
        self.totals: dict = {}

    def add(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - t0
        return now


def autoregressive(engine, prompt_ids: list, sp: SamplingParams, sink: TokenSink) -> dict:
    """Plain decoding: prefill, then one target forward per token. Returns stats."""
    model, cache = engine.model, engine.cache
    dev = model.device
    gen = sp.generator(dev)
    P = len(prompt_ids)
    cache.reset()
    logits = model.forward(torch.tensor(prompt_ids, device=dev), torch.arange(P, device=dev),
                           torch.arange(P, device=dev), cache, logits_idx=torch.tensor([P - 1], device=dev))
    cache.length = P
    steps = 1
    tok = sp.pick(logits[0], gen)
    one = torch.empty(1, dtype=torch.long, device=dev)
    while not sink.push(tok):
        n = cache.length
        one.fill_(n)
        logits = model.forward(torch.tensor([tok], device=dev), one, one, cache)
        cache.length = n + 1
        steps += 1
        tok = sp.pick(logits[0], gen)
    return {"decoding_steps": steps}


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
