"""What every decoding method shares: sampling settings and the sampler, the token sink (stop rules, streaming,
cancellation), prefill, plain autoregressive decoding, and the typed result and statistics.

The sink takes tokens one at a time, so a method that emits several tokens per round (SWIFT) stops at exactly the
token plain autoregressive decoding would have stopped at.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..errors import SwiftkError
from ..runtime.ops.cpu_linear import topk_rows
from ..runtime.sampling import process_logits, validate_sampling_params

MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def validate(self) -> "SamplingParams":
        validate_sampling_params(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise SwiftkError(f"seed must be None or an int in [0, 2**63-1], got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, self.temperature, self.top_k, self.top_p)


class Sampler:
    """The target's choice of the next token, as a score whose argmax is that choice.

    Greedy: the logits. Sampling (coupled, the default): Gumbel-max with noise keyed by (seed, position), i.e. the
    token at absolute position t is ``argmax_x log p_t(x) + G_t(x)`` with G_t i.i.d. Gumbel drawn from a generator
    seeded by (seed, t). That is an exact draw from p_t (the processed target distribution), and it is a
    deterministic function of the seed, the position and the context: any draft verified against it emits exactly
    the tokens autoregressive decoding with the same seed emits. Seeded sampling is therefore reproducible across
    methods, skip sets and engine states. ``rejection`` keeps SpecInfer-style tree rejection sampling
    (acceptance.accept_sampling) for the speculative rounds; its output depends on the draft.
    """

    def __init__(self, sp: SamplingParams, device, rule: str = "coupled"):
        self.sp, self.device, self.rule = sp, torch.device(device), rule
        self.seed = sp.seed if sp.seed is not None else random.SystemRandom().randrange(MAX_SEED)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self._noise: dict = {}

    @property
    def greedy(self) -> bool:
        return self.sp.greedy

    def noise(self, position: int, V: int) -> torch.Tensor:
        g = self._noise.get(position)
        if g is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((self.seed * 0x9E3779B97F4A7C15 + position) % MAX_SEED)
            u = torch.rand(V, generator=gen, device=self.device).clamp_(1e-20, 1.0 - 1e-7)
            g = self._noise[position] = -torch.log(-torch.log(u))
        return g

    def release(self, below: int) -> None:
        """Forget the noise of positions already committed."""
        for p in [p for p in self._noise if p < below]:
            del self._noise[p]

    def scores(self, logits: torch.Tensor, positions) -> torch.Tensor:
        """[N, V] logits of the rows predicting ``positions`` -> scores whose row argmax is the choice."""
        if self.greedy:
            return logits
        logp = torch.log(self.sp.probs(logits))
        V = logits.shape[-1]
        return logp + torch.stack([self.noise(int(p), V) for p in positions])

    def pick(self, logits_row: torch.Tensor, position: int) -> int:
        return int(topk_rows(self.scores(logits_row[None], [position]), 1)[0, 0])   # torch.argmax's choice


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
        if not self.done and self.cancel is not None and self.cancel.is_set():
            self.finish_reason = "cancelled"
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


def prefill(model, cache, prompt_ids: list, sampler: Sampler) -> int:
    """Target pass over the prompt (KV into slots [0, P)); returns the first new token (not yet in the cache)."""
    dev = model.device
    P = len(prompt_ids)
    cache.reset()
    ar = torch.arange(P, device=dev)
    logits = model.forward(torch.tensor(prompt_ids, device=dev), ar, ar, cache,
                           logits_idx=torch.tensor([P - 1], device=dev))
    cache.advance(P)
    return sampler.pick(logits[0], P)


def plain_step(model, cache, token: int, sampler: Sampler) -> int:
    """One autoregressive step: ``token`` goes into the cache, the next token comes back."""
    return step_logits(model, cache, token, sampler)[0]


def step_logits(model, cache, token: int, sampler: Sampler) -> tuple:
    """:func:`plain_step` that also returns the target's scores [1, V] for the next position."""
    dev = model.device
    n = cache.length
    pos = torch.tensor([n], device=dev)
    logits = model.forward(torch.tensor([token], device=dev), pos, pos, cache, start=n)
    cache.advance(1)
    sampler.release(n + 1)
    return sampler.pick(logits[0], n + 1), logits


def autoregressive(model, cache, prompt_ids: list, sampler: Sampler, sink: TokenSink) -> DecodeStats:
    """Plain decoding: prefill, then one target forward per token."""
    t = time.perf_counter()
    tok = prefill(model, cache, prompt_ids, sampler)
    t_prefill = time.perf_counter() - t
    steps = 1
    while not sink.push(tok):
        tok = plain_step(model, cache, tok, sampler)
        steps += 1
    return DecodeStats(decoding_steps=steps, plain_steps=steps - 1, time_prefill_s=t_prefill)


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


def stream_pieces(generate, prompt, **kw):
    """``generate(prompt, callback=..., _cancel=..., **kw)`` in a worker thread, its text pieces yielded as they
    come; closing the iterator cancels the generation at its next token."""
    import queue

    q: queue.Queue = queue.Queue()
    done, box, cancel = object(), {}, threading.Event()

    def run():
        try:
            box["result"] = generate(prompt, callback=q.put, _cancel=cancel, **kw)
        except BaseException as e:  # surfaced in the consumer
            box["error"] = e
        finally:
            q.put(done)

    th = threading.Thread(target=run, daemon=True, name="swiftk-stream")
    th.start()
    try:
        while (item := q.get()) is not done:
            yield item
    finally:
        cancel.set()
        th.join()
    if "error" in box:
        raise box["error"]
