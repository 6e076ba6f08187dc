"""What the target's passes cost on the device it runs on: the figures every draft is priced with.

Speed model (docs/design.md): with one decode step costing ``step`` seconds, a round that drafts k tokens at ``draft``
each and verifies T nodes at ``v(T)`` emits M tokens; it pays when M / (k*draft + v(T)) > 1 / step.

:class:`CostModel` starts from priors (a draft step costs the share of weight bytes it reads, plus an overhead
share; a verify pass of T tokens costs ``1 + slope*(T-1)`` steps) and refines every figure from the passes it
observes (exponential moving averages); on CPU the prior's slope is timed at load (``calibrate``: two passes), and
the engine persists the figures per device.
decoding/gate.py's :class:`Gate` turns it and the sources' acceptance estimates into per-round decisions.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..errors import SwiftkError
from ..runtime.model import nbytes
from ..runtime.ops import cpu_quant

_EMA = 0.2
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Observations (steps and verify passes) after which a verify estimate above the prior has moved halfway back to
# it. A pessimistic estimate is self-sealing -- the gate stops choosing that size, so nothing corrects it; an
# optimistic one is corrected by the passes it invites.
_HALF_LIFE = 512


def ema(old: Optional[float], new: float) -> float:
    if old is None:
        return new
    new = min(new, 3.0 * old)  # one OS hiccup must not swing the model
    return old + _EMA * (new - old)


def _pairs_kernel() -> bool:
    try:
        return cpu_quant.pairs_rows()
    except SwiftkError:   # no kernel library: nothing runs in pairs
        return False


class CostModel:
    def __init__(self, model):
        c, L0 = model.cfg, model.layers[0]
        self.attn_bytes = sum(nbytes(t) for t in (L0.wqkv, L0.wo))
        self.mlp_bytes = sum(nbytes(t) for t in (L0.w_gate_up, L0.w_down))
        self.head_bytes = nbytes(model.lm_head)
        self.total_bytes = c.n_layers * (self.attn_bytes + self.mlp_bytes) + self.head_bytes
        gpu = model.device.type == "cuda"
        # prior: extra verify cost per token, in steps (measured figures: docs/design.md, bench/results/history.md). A
        # cold engine prices its first rounds with it, so it errs on the costly side. CPU GGUF blocks: int8
        # activations measured 0.15-0.2 on AVX2, float32 activations 0.3-0.35; float32 weights 0.05-0.07.
        native = getattr(model, "weights", None) == "native"
        act = getattr(model, "activations", "int8")
        self.slope = 0.004 if gpu else (0.2 if act == "int8" else 0.35) if native else 0.07
        # where the int8 kernel pairs activation rows, an odd pass costs what the next even one does: priced and
        # filed as that, it no longer inflates the smaller bucket (cpu_quant.pairs_rows)
        self.pairs = not gpu and native and act == "int8" and _pairs_kernel()
        self.step: Optional[float] = None     # seconds of a plain decode step
        # bucket -> a verify pass of that many tokens, in decode steps: a ratio survives a machine that got
        # uniformly slower or faster since it was measured (another job, another process's persisted figures)
        self.verify: dict = {}
        self._seen: dict = {}                 # bucket -> clock of its last observation
        self._clock = 0                       # observations so far (the age unit of _HALF_LIFE)
        self._memo, self._memo_clock = {}, 0  # T -> ratio(T), rebuilt on a verify observation or as beliefs age
        self.overhead = 0.1                   # share of a step a draft never saves (launches, norms, Python)
        self.opt: Optional[float] = None      # seconds of one matchness pass

    @property
    def clock(self) -> int:
        """Observations so far: callers caching a figure derived from the model refresh it as this advances."""
        return self._clock

    # ---- observations
    def observe_step(self, dt: float) -> None:
        self.step = ema(self.step, dt)
        self._clock += 1

    def observe_verify(self, T: int, dt: float) -> None:
        if T == 1:
            return self.observe_step(dt)
        T = self.priced_as(T)
        if self.step is None:   # no plain step yet: the prior's shape stands in for one
            return self.observe_step(dt / self._prior_v(T))
        b = min(BUCKETS, key=lambda x: abs(x - T))
        r = dt / self.step * self._prior_v(b) / self._prior_v(T)
        old = self.verify.get(b)
        if old is None:  # a first observation is clipped too (to 3x the estimate so far): one hiccup must not stick
            r = min(r, 3.0 * self.ratio(b))
        self.verify[b] = ema(old, r)
        self._seen[b] = self._clock
        self._clock += 1
        self._memo.clear()

    def observe_draft(self, kf: float, dt: float) -> None:
        """A draft step that read ``kf`` of a decode step's weight bytes took ``dt`` seconds."""
        if self.step is None:
            return
        if kf < 0.999:
            o = min(0.95, max(0.0, (dt / self.step - kf) / (1.0 - kf)))
            self.overhead += _EMA * (o - self.overhead)

    def calibrate(self, step_s: float, pass_s: float, T: int) -> None:
        """The prior's slope from this machine's own step and T-token pass (timed_passes, at
        load): the table of slopes measured elsewhere was off by 2-3x here (AVX-512 VNNI: 0.07-0.1 against the
        AVX2 prior of 0.2), and a pessimistic figure seals itself -- the gate never tries the sizes it overprices.
        Timed at a short context, it errs on the cheap side, which the passes it invites correct."""
        if step_s > 0 and pass_s > 0 and T > 1:
            self.slope = min(0.5, max(0.01, (pass_s / step_s - 1.0) / (T - 1)))
            self._memo.clear()

    def observe_opt(self, dt: float) -> None:
        self.opt = ema(self.opt, dt)

    # ---- estimates (seconds)
    def _prior_v(self, T: float) -> float:
        return 1.0 + self.slope * (T - 1)

    def v(self, T: int) -> float:
        """Seconds of a verify pass over T tokens."""
        return (self.step or 1.0) * self.ratio(T)

    def priced_as(self, T: int) -> int:
        """The pass size whose cost a pass of T tokens has: T + 1 for an odd T >= 3 where rows go in pairs."""
        return T + 1 if self.pairs and T >= 3 and T % 2 else T

    def ratio(self, T: int) -> float:
        """A verify pass over T tokens in decode steps: the nearest measured bucket scaled by the prior's shape,
        never above a measured larger pass (noise), never below one step."""
        if T <= 1:
            return 1.0
        T = self.priced_as(T)
        if not self._memo or self._clock - self._memo_clock >= 32:   # beliefs age: refresh now and then, not per step
            self._memo, self._memo_clock = {}, self._clock
        r = self._memo.get(T)
        if r is None:
            if not self.verify:
                r = self._prior_v(T)
            else:
                b = min(self.verify, key=lambda x: abs(x - T))
                r = self._believed(b) * self._prior_v(T) / self._prior_v(b)
                r = min([r] + [self._believed(x) for x in self.verify if x >= T])
            r = self._memo[T] = max(1.0, r)
        return r

    def _believed(self, b: int) -> float:
        """The estimate for bucket b; one above the prior drifts back to it while b goes unobserved."""
        r, p = self.verify[b], self._prior_v(b)
        if r <= p:
            return r
        age = self._clock - self._seen.get(b, self._clock)
        return p + (r - p) * 0.5 ** (age / _HALF_LIFE)

    def kept_fraction(self, skip: Optional[torch.Tensor], head_bytes: Optional[int] = None) -> float:
        """Share of the weight bytes a draft step with ``skip`` reads (the LM head is never skipped; a reduced
        draft head reads ``head_bytes``)."""
        if skip is None:
            return 1.0
        s = skip.view(-1, 2).cpu()
        n_attn, n_mlp = int(s[:, 0].sum()), int(s[:, 1].sum())
        head = self.head_bytes if head_bytes is None else head_bytes
        kept = (self.total_bytes - self.head_bytes + head - n_attn * self.attn_bytes - n_mlp * self.mlp_bytes)
        return kept / self.total_bytes

    def draft(self, kf: float) -> float:
        """Seconds of a draft step that reads ``kf`` of the weight bytes."""
        step = self.step or 1.0
        return step * (self.overhead + (1.0 - self.overhead) * kf)

    def expected_rate(self, matchness: float, kf: float, max_k: int = 16) -> float:
        """Tokens per step-time of drafting chains with per-token acceptance ``matchness``, at the best depth
        (the optimizer's speed objective; 1.0 = plain decoding)."""
        step = self.step or 1.0
        c, best, tokens, surv = self.draft(kf), 0.0, 1.0, 1.0
        for k in range(1, max_k + 1):
            surv *= matchness
            tokens += surv
            best = max(best, tokens * step / (k * c + self.v(k + 1)))
        return best

    def break_even(self, kf: float) -> float:
        """The per-token acceptance at which drafting chains that read ``kf`` of the weight bytes just matches
        plain decoding (``expected_rate`` = 1); above 1.0 where not even full acceptance would."""
        if self.expected_rate(1.0, kf) < 1.0:
            return 2.0
        lo, hi = 0.0, 1.0
        for _ in range(16):   # expected_rate grows with the acceptance
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.expected_rate(mid, kf) >= 1.0 else (mid, hi)
        return hi

    def budget(self, limit: float = 1.6) -> int:
        """Largest tree whose verify pass costs at most ``limit`` steps (speculate='always' with auto budget)."""
        step = self.step or 1.0
        return max([T for T in BUCKETS if T >= 4 and self.v(T) <= limit * step] or [4])

    def to_dict(self) -> dict:
        step = self.step or 1.0
        return {"step_s": self.step, "verify_s": {str(k): r * step for k, r in sorted(self.verify.items())},
                "draft_overhead": self.overhead, "opt_step_s": self.opt, "attn_bytes": self.attn_bytes,
                "mlp_bytes": self.mlp_bytes, "head_bytes": self.head_bytes}

    def load_dict(self, d: dict) -> None:
        step, opt = d.get("step_s"), d.get("opt_step_s")
        for name, v in (("step_s", step), ("opt_step_s", opt)):   # no pass takes under a microsecond
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 1e-6 < v < 60):
                raise ValueError(f"implausible {name} {v!r}")
        self.step = step
        # seconds in the file (readable), ratios here; figures from another process count as two half-lives old
        # (one above the prior is a quarter believed: it may come from a run that shared the machine)
        self.verify = {int(k): float(v) / step for k, v in (d.get("verify_s") or {}).items()
                       if step and int(k) in BUCKETS and 0 < float(v) < 60}
        self._seen = {b: self._clock - 2 * _HALF_LIFE for b in self.verify}
        self._memo.clear()
        self.overhead = min(0.95, max(0.0, float(d.get("draft_overhead", self.overhead))))
        self.opt = opt



class LinearFit:
    """y = a + b x, fitted online by least squares with older points forgotten geometrically (``decay`` per point):
    a pass's seconds against its rows (decoding/batch.py), vLLM's step against its tokens (integrations/batch.py)."""

    def __init__(self, decay: float = 0.98, min_points: int = 16):
        self.decay, self.min_points = decay, min_points
        self.w = self.t = self.y = self.tt = self.ty = 0.0   # weighted sums: 1, x, y, x^2, x y
        self.n = 0

    def add(self, x: float, y: float) -> None:
        g = self.decay
        self.w, self.t, self.y = g * self.w + 1, g * self.t + x, g * self.y + y
        self.tt, self.ty = g * self.tt + x * x, g * self.ty + x * y
        self.n += 1

    def fit(self) -> Optional[tuple]:
        """(a, b), or None while there is too little to go on (few points, no spread in x, b <= 0)."""
        var = self.w * self.tt - self.t * self.t
        if self.n < self.min_points or var <= 1e-9 * max(self.w * self.tt, 1e-30):
            return None
        b = (self.w * self.ty - self.t * self.y) / var
        a = (self.y - b * self.t) / self.w
        return (a, b) if b > 0 and a + b * self.t / self.w > 0 else None


def timed_passes(model, cache, T: int = 8, context: int = 256, reps: int = 3) -> tuple:
    """Seconds of a one-token step and of a T-token pass (each the best of ``reps``, after one untimed pass of
    each that also pages the weights in) after ``context`` cached slots (what is in them does not change the
    cost); the cache is left empty. The cost model's first figures on an engine (CostModel.calibrate)."""
    dev = model.device
    ids = torch.arange(T, device=dev) % model.cfg.vocab_size
    P = max(0, min(context, cache.max_slots - T))
    best = [float("inf"), float("inf")]
    for r in range(reps + 1):
        for j, n in enumerate((1, T)):
            cache.reset()
            cache.advance(P)
            pos = torch.arange(P, P + n, device=dev)
            t = time.perf_counter()
            model.forward(ids[:n], pos, pos, cache)
            if r:
                best[j] = min(best[j], time.perf_counter() - t)
    cache.reset()
    return best[0], best[1]
